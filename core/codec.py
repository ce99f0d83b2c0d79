"""config.json's codec: the one place a stage config meets the names config.json records.

Everywhere else a config is its tree (core/tree.py) and a leaf is named by its path
(`optim.lr`, `loss.csm.weight`). config.json records each leaf under the name it had when the
first runs were written (`lr`, `csm_weight`: the stage's `LEGACY`, stages/configs/legacy.py;
a picking section's `name` leaf as the section's name, `loss`), so every output recorded before
keeps its bytes, and with them its identity: a root written then is complete now.

`encode` writes a config as config.json holds it (the identity rule of each leaf, said at the
leaf: `not_recorded`, `recorded_off_default`, `recorded_along` in core/config.py); `decode` reads
a config.json back as {path: value}; `load` gives a recorded folder's config as the stage's
typed config, so a reader of another stage's folder (the labelled budget, evaluate's report,
fit-generator's recheck, the benchmarks) asks `cfg.fidelity.judge`, never `"judge_run"`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from core.io import read_json
from core.tree import PICK, field_default, get, items, leaves, picks, shown, spelt

CONFIG_JSON = "config.json"

# What config.json holds (an output's identity, which a rerun is compared on) is said once, at
# each field, in its metadata (core.config's not_recorded / recorded_off_default /
# recorded_along; `encode` reads it): every field, unless it says SKIP (how or where an output is
# made, not what it holds), OFF_DEFAULT (a field added after outputs were written: theirs keep
# their bytes and resume) or ALONG (recorded exactly when another field is: an option of that
# one).
IDENTITY, SKIP, OFF_DEFAULT, ALONG = "identity", "skip", "off-default", "along"


def key(cls: type, path: str) -> str:
    """The name config.json records the leaf `path` under: its legacy flat name (`optim.lr`:
    `lr`), a picking section's `name` leaf as the section's name (`loss.name`: `loss`), else
    the path itself (a top-level field: its name)."""
    head, _, rest = path.partition(".")
    if rest == PICK and picks(cls, head):
        return head
    return {p: name for name, p in getattr(cls, "LEGACY", {}).items()}.get(path, path)


def path(cls: type, recorded: str) -> str:
    """The leaf a config.json key names: the inverse of `key`."""
    return spelt(cls, recorded)


def jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


class Recorded(dict):
    """A config.json's {recorded key: value} (`encode`) that knows how the command line names
    each key: `named(key)`, its tree path (`lr` -> `optim.lr`). The keys and values are what is
    compared and written; the names are for the messages about them
    (shards.writer.check_config: `differs in: optim.lr`)."""

    def __init__(self, values: Mapping[str, Any], config_cls: type) -> None:
        super().__init__(values)
        self.config_cls = config_cls

    def named(self, recorded: str) -> str:
        return shown(self.config_cls, path(self.config_cls, recorded))


def encode(config: Any) -> Recorded:
    """What a stage writes as its config.json: the leaves its metadata keeps (IDENTITY), each
    under its recorded name (`key`), so every config.json keeps its bytes."""
    cls = type(config)
    rows = {leaf.path: leaf for leaf in leaves(cls)}

    def kept(at: str) -> bool:
        f = rows[at].field
        rule = f.metadata.get(IDENTITY)
        if rule == ALONG:  # a sibling in the same section
            return kept(at.rpartition(".")[0] + "." * ("." in at) + f.metadata[ALONG])
        off = rule == OFF_DEFAULT and get(config, at) == field_default(f)
        return rule != SKIP and not off

    return Recorded({key(cls, p): jsonable(get(config, p)) for p in rows if kept(p)}, cls)


def every_leaf(config: Any) -> dict[str, Any]:
    """Every leaf under its recorded name, those `encode` leaves out included: what the trackers
    are given, so a tracked run's hyperparameters read as its config.json."""
    return {key(type(config), p): jsonable(value) for p, value in items(config)}


def decode(cls: type, recorded: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json's {key: value} as {path: value} of the config class `cls`: lists back to
    tuples; a key no leaf of `cls` has (a field since removed) is left out, so an older
    config.json still reads."""
    known = {leaf.path for leaf in leaves(cls)}
    values = {}
    for name, value in recorded.items():
        at = path(cls, name)
        if at in known:
            values[at] = tuple(value) if isinstance(value, list) else value
    return values


C = TypeVar("C")


def load(cls: type[C], folder: Path) -> C:
    """The typed config recorded in `folder`/config.json: what it records, the defaults for
    what it leaves out (a leaf recorded off its default only, or not recorded: where the output
    lived, how it was read). FileNotFoundError when the folder records none."""
    return cls(**decode(cls, read_json(Path(folder) / CONFIG_JSON)))
