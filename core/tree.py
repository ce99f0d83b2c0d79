"""A stage config as a tree: typed sections, each a frozen dataclass held by a field.

`--set optim.lr=0.05` names a leaf by its path; a stage's `LEGACY` ({flat name: path}, the one
table in stages/configs/legacy.py) maps the flat names older runs recorded and older command
lines spelt onto the paths. Building a config takes paths and flat names alike (the metaclass
`Tree` spells them as sections), so `Config(lr=0.05)`, `Config(**{"optim.lr": 0.05})` and
`dataclasses.replace(cfg, lr=0.05)` give the same config.

A section that picks one of several parts (train's `loss`, generate's `backend`, annotate's
`encoder`: core.parts.Section.tree) has a leaf `name` saying which, and the section's own name
stands for that leaf: `loss=csm` sets `loss.name`, and config.json records it as `loss`.
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


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "(required)"


PICK = "name"  # the leaf of a section that picks a part (`loss.name`)


def picks(cls: type, name: str) -> bool:
    """Whether the field `name` of `cls` is a section that picks a part (it has `PARTS`)."""
    hint = _hints(cls).get(name)
    return is_section(hint) and getattr(hint, "PARTS", None) is not None


def spelt(cls: type, key: str) -> str:
    """The path a key names: a path as it is, a legacy flat name as its path, a picking
    section's name as its `name` leaf."""
    path = getattr(cls, "LEGACY", {}).get(key, key)
    return f"{key}.{PICK}" if path == key and picks(cls, key) else path


def shown(cls: type, path: str) -> str:
    """How --fields and the errors name a leaf: its path; a picking section's `name` leaf by
    the section's name (`loss`)."""
    head, _, rest = path.partition(".")
    return head if rest == PICK and picks(cls, head) else path


def nested(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `cls` from {path or legacy name: value}: dotted keys become their
    sections (merged onto a given section value, else the field's default)."""
    top: dict[str, Any] = {}
    inner: dict[str, dict[str, Any]] = {}
    names = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in values.items():
        path = key if is_section(type(value)) else spelt(cls, key)  # a section's value as given
        head, dot, rest = path.partition(".")
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
        built = super().__call__(*args, **nested(cls, kwargs))
        check = getattr(built, "check_leaves", None)  # core.config: the leaves' ranges
        if check is not None:
            check()
        return built


def items(obj: Any) -> Iterator[tuple[str, Any]]:
    """(path, value) of every leaf of a built config."""
    for leaf in leaves(type(obj)):
        yield leaf.path, get(obj, leaf.path)
