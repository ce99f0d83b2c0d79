"""The study's protocol: docs/protocol.toml, committed before the run, read once into a frozen
`Protocol` (the endpoints, margins and relative goal; the seeds; the generator's fits, floor and
cap; every tuning grid with its bounds, the shared weight-decay grid, the extension cap).

The study's modules read their constants from `PROTOCOL` (the committed file), so the numbers a
verdict rests on live in one file a reviewer can diff; a study records the file's sha256 and
the code's commit in study.json and keeps the sha256 it started with in study/protocol.lock
(pipeline/study/command.py), so a protocol edited after the start turns its verdicts exploratory.

A bad file fails in one line naming the key. tomllib needs Python >= 3.11 (the project's floor is
3.10; tomli, its backport, is not a dependency): on 3.10 the study says so in one line.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
COMMITTED = "docs/protocol.toml"  # relative to the repository root
WHEN = ("before_ts", "after_ts")
SEARCHES = ("coordinate",)


@dataclass(frozen=True)
class Param:
    """One tuning parameter: its grid values, its reference (untuned) value, its bounds."""

    values: tuple[float, ...]
    reference: float
    bounds: tuple[float, float]


@dataclass(frozen=True)
class RelativeGoal:
    """ "method's metric at least `below` (a fraction) below reference's": met only where the
    whole relative interval ((method − reference) / reference's mean) lies below −below."""

    when: str
    metric: str
    method: str
    reference: str
    below: float

    def applies(self, when: str | None, metric: str, method: str, reference: str) -> bool:
        return (when, metric, method, reference) == (
            self.when,
            self.metric,
            self.method,
            self.reference,
        )

    def text(self) -> str:
        return f"{self.method}'s {self.metric} >= {100 * self.below:g} % below {self.reference}'s"


@dataclass(frozen=True)
class Protocol:
    primary_endpoints: tuple[tuple[str, str, str, str], ...]  # (when, metric, method, reference)
    margins: dict[str, float]
    relative_goal: RelativeGoal
    seeds: tuple[int, ...]  # the study seeds
    primary_seeds: int
    other_seeds: int
    tune_seeds: int
    tune_first: int
    fits: int
    mixed_sets_per_fit: int
    fidelity_floor: float
    max_cells: int
    search: str
    max_extensions: int  # per parameter
    weight_decay: Param
    grids: dict[str, dict[str, Param]]  # {group: {parameter: Param}}, in the file's order


def resolve(path: str | Path) -> Path:
    """A protocol path: absolute as given, relative from the repository root."""
    path = Path(path)
    return path if path.is_absolute() else REPO / path


def sha256(path: str | Path) -> str:
    return hashlib.sha256(resolve(path).read_bytes()).hexdigest()


def _get(table: dict[str, Any], key: str, where: str, kind: type | tuple[type, ...]) -> Any:
    """table[key], checked: its type, else one line naming `where.key`."""
    name = f"{where}.{key}" if where else key
    if key not in table:
        raise ConfigError(f"protocol: {name} is missing")
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"protocol: {name} = {value!r} is not {_kind(kind)}")
    return value


KINDS = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a table"}


def _kind(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(KINDS[k] for k in kinds if not (k is int and float in kinds))


def _positive(value: float, name: str) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"protocol: {name} = {value!r} must be a positive number")
    return float(value)


def _count(table: dict[str, Any], key: str, where: str) -> int:
    value = _get(table, key, where, int)
    if value < 1:
        raise ConfigError(f"protocol: {where}.{key} = {value} must be >= 1")
    return value


def _param(table: dict[str, Any], key: str, where: str) -> Param:
    """A grid parameter: >= 2 distinct positive values (geometric steps), the reference one of
    them, bounds [lo, hi] around every value."""
    name = f"{where}.{key}"
    spec = _get(table, key, where, dict)
    values = tuple(
        _positive(v, f"{name}.values") for v in _get(spec, "values", name, list) if _number(v, name)
    )
    if len(set(values)) != len(values) or len(values) < 2:
        raise ConfigError(f"protocol: {name}.values = {list(values)} needs >= 2 distinct values")
    reference = _positive(_get(spec, "reference", name, (int, float)), f"{name}.reference")
    if reference not in values:
        raise ConfigError(f"protocol: {name}.reference = {reference:g} is not one of its values")
    bounds = _get(spec, "bounds", name, list)
    if len(bounds) != 2 or not all(_number(b, name) for b in bounds):
        raise ConfigError(f"protocol: {name}.bounds = {bounds!r} must be [low, high]")
    lo, hi = (_positive(b, f"{name}.bounds") for b in bounds)
    if not lo <= min(values) <= max(values) <= hi:
        raise ConfigError(
            f"protocol: {name}.bounds = [{lo:g}, {hi:g}] must hold every value {list(values)}"
        )
    unknown = set(spec) - {"values", "reference", "bounds"}
    if unknown:
        raise ConfigError(f"protocol: {name} has unknown key(s) {sorted(unknown)}")
    return Param(values, reference, (lo, hi))


def _number(value: Any, name: str) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"protocol: {name} holds {value!r}, not a number")
    return True


def parse(data: dict[str, Any]) -> Protocol:
    """The protocol from the TOML's tables, every key checked (one line naming it)."""
    endpoints = _get(data, "endpoints", "", dict)
    primary = []
    for i, e in enumerate(_get(endpoints, "primary", "endpoints", list)):
        if not (isinstance(e, list) and len(e) == 4 and all(isinstance(x, str) for x in e)):
            raise ConfigError(
                f"protocol: endpoints.primary[{i}] = {e!r} must be [when, metric, method, "
                "reference]"
            )
        if e[0] not in WHEN:
            raise ConfigError(
                f"protocol: endpoints.primary[{i}] when {e[0]!r} is not one of {WHEN}"
            )
        primary.append(tuple(e))
    margins_table = _get(endpoints, "margins", "endpoints", dict)
    margins = {
        k: _positive(_get(margins_table, k, "endpoints.margins", (int, float)), f"margins.{k}")
        for k in margins_table
    }
    for _, metric, _, _ in primary:
        if metric not in margins:
            raise ConfigError(f"protocol: endpoints.margins.{metric} is missing (a primary metric)")
    goal = _get(endpoints, "relative_goal", "endpoints", dict)
    where = "endpoints.relative_goal"
    fields = {k: _get(goal, k, where, str) for k in ("when", "metric", "method", "reference")}
    below = float(_get(goal, "below", where, (int, float)))
    if not 0 < below < 1:
        raise ConfigError(f"protocol: {where}.below = {below:g} must be a fraction in (0, 1)")
    seeds = _get(data, "seeds", "", dict)
    study = _get(seeds, "study", "seeds", list)
    if not study or not all(isinstance(s, int) and not isinstance(s, bool) for s in study):
        raise ConfigError(f"protocol: seeds.study = {study!r} must be a non-empty list of integers")
    generator = _get(data, "generator", "", dict)
    floor = float(_get(generator, "fidelity_floor", "generator", (int, float)))
    if not 0 <= floor <= 100:
        raise ConfigError(f"protocol: generator.fidelity_floor = {floor:g} must be a % in [0, 100]")
    tuning = _get(data, "tuning", "", dict)
    search = _get(tuning, "search", "tuning", str)
    if search not in SEARCHES:
        raise ConfigError(f"protocol: tuning.search = {search!r} is not one of {SEARCHES}")
    grids = _get(tuning, "grids", "tuning", dict)
    return Protocol(
        primary_endpoints=tuple(primary),
        margins=margins,
        relative_goal=RelativeGoal(**fields, below=below),
        seeds=tuple(study),
        primary_seeds=_count(seeds, "primary", "seeds"),
        other_seeds=_count(seeds, "other", "seeds"),
        tune_seeds=_count(seeds, "tune", "seeds"),
        tune_first=_get(seeds, "tune_first", "seeds", int),
        fits=_count(generator, "fits", "generator"),
        mixed_sets_per_fit=_count(generator, "mixed_sets_per_fit", "generator"),
        fidelity_floor=floor,
        max_cells=_count(generator, "max_cells", "generator"),
        search=search,
        max_extensions=_count(tuning, "max_extensions", "tuning"),
        weight_decay=_param(tuning, "weight_decay", "tuning"),
        grids={group: _grid(grids, group) for group in grids},
    )


def _grid(grids: dict[str, Any], group: str) -> dict[str, Param]:
    table = _get(grids, group, "tuning.grids", dict)
    return {key: _param(table, key, f"tuning.grids.{group}") for key in table}


def load(path: str | Path = COMMITTED) -> Protocol:
    """The protocol at `path` (relative: from the repository root); one line for a missing,
    malformed or incomplete file, naming it and the key."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise ConfigError("the study's protocol needs Python >= 3.11 (tomllib)") from None
    file = resolve(path)
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{path}: protocol: cannot read it ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: protocol: not valid TOML ({e})") from None
    try:
        return parse(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


LOCK = "protocol.lock"  # in the study's folder: the protocol's sha256 and the code at its start


def check_same(path: str | Path) -> None:
    """A study's protocol file must hold the committed file's values: the study's modules read
    the committed one (PROTOCOL). One line naming the file and the fix otherwise."""
    if resolve(path) != resolve(COMMITTED) and load(path) != PROTOCOL:
        raise ConfigError(
            f"study.protocol={path}: its values differ from {COMMITTED}, which the study's code "
            f"reads; commit the change to {COMMITTED} (or leave study.protocol unset)"
        )


def lock(folder: Path, path: str | Path, code: str | None) -> dict[str, Any]:
    """The protocol as the study started with it: study/protocol.lock, written once, before its
    first task (a later invocation reads it back); {"sha256", "code"}."""
    from core.io import atomic_write_json, read_json

    file = folder / LOCK
    if not file.is_file():
        atomic_write_json(file, {"sha256": sha256(path), "code": code})
    return read_json(file)


def record(folder: Path, path: str | Path) -> dict[str, Any]:
    """study.json's "protocol": the file, its sha256 now and at the start, the code's commit at
    the start, and whether it changed since (then every verdict is exploratory)."""
    started = lock(folder, path, None)
    now = sha256(path)
    return {
        "file": str(path),
        "sha256": now,
        "started_sha256": started["sha256"],
        "code": started["code"],
        "changed": now != started["sha256"],
        "verdicts": "exploratory" if now != started["sha256"] else "confirmatory",
    }


PROTOCOL = load()  # the committed protocol: the values every study module reads
