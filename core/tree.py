"""A stage config as a tree: typed sections, each a frozen dataclass held by a field.

`--set optim.lr=0.05` names a leaf by its path; a stage's `LEGACY` ({flat name: path}, the one
table in stages/configs/legacy.py) maps the flat names older runs recorded and older command
lines spelt onto the paths. Building a config takes paths and flat names alike (the metaclass
`Tree` spells them as sections), so `Config(lr=0.05)`, `Config(**{"optim.lr": 0.05})` and
`dataclasses.replace(cfg, lr=0.05)` give the same config.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Iterator, Mapping
from typing import Any


def section(cls: type, **defaults: Any) -> Any:
    """A config field holding the section `cls`, its defaults here `defaults` (a stage's own
    recipe: fit-generator's lr is not train's)."""
    return dataclasses.field(default_factory=functools.partial(cls, **defaults))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One leaf of a config tree: its path (`optim.lr`), field, type and declaring section."""

    path: str
    field: dataclasses.Field
    hint: Any
    owner: type


def leaves(cls: type, prefix: str = "") -> list[Leaf]:
    """Every leaf of the tree of `cls`, depth first in declaration order."""
    found = []
    for f in dataclasses.fields(cls):
        hint = _hints(cls)[f.name]
        if is_section(hint):
            found += leaves(hint, f"{prefix}{f.name}.")
        else:
            found.append(Leaf(f"{prefix}{f.name}", f, hint, cls))
    return found


def get(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def spelt(cls: type, key: str) -> str:
    """The path a key names: a path as it is, a legacy flat name as its path."""
    return getattr(cls, "LEGACY", {}).get(key, key)


def nested(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `cls` from {path or legacy name: value}: dotted keys become their
    sections (merged onto a given section value, else the field's default)."""
    top: dict[str, Any] = {}
    inner: dict[str, dict[str, Any]] = {}
    names = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in values.items():
        head, dot, rest = spelt(cls, key).partition(".")
        if dot and head in names and is_section(_hints(cls)[head]):
            inner.setdefault(head, {})[rest] = value
        else:
            top[head if not dot else key] = value
    for head, sub in inner.items():
        hint = _hints(cls)[head]
        base = top.get(head)
        if base is None:
            f = names[head]
            base = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        merged = nested(hint, sub)
        top[head] = dataclasses.replace(base, **merged) if base is not None else hint(**merged)
    return top


class Tree(type):
    """Metaclass of the stage configs: a config is built from paths and legacy names alike."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **nested(cls, kwargs))


def items(obj: Any) -> Iterator[tuple[str, Any]]:
    """(path, value) of every leaf of a built config."""
    for leaf in leaves(type(obj)):
        yield leaf.path, get(obj, leaf.path)
