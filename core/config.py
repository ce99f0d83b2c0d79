"""Typed stage configs, named presets and `--set key=value` overrides.

Each stage has one frozen dataclass in `stages/configs/<stage>.py` deriving from
`StageConfig`, a tree of leaves and typed sections (core/tree.py: `optim.lr`), plus `PRESETS`:
its values of every preset (stages/presets/, the one place that names them), the leaf values
that differ from the defaults, by path. Resolution order: dataclass defaults < preset < `--set`.
A preset may hold `when={"field=value": {...}}`: values that apply only when the field resolves
to that value. The resolved config is what a stage writes into its folder as config.json, through
the one codec that knows config.json's names (core/codec.py).

A field's description is the `# comment` at the end of its line (else the comment lines right
above it): `--fields` reads them from the source (core/fielddocs.py), so they live in one place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, TypeVar

from core.codec import (  # what config.json holds, said at the field (core/codec.py)
    ALONG,
    IDENTITY,
    OFF_DEFAULT,
    SKIP,
    Recorded,
    encode,
    every_leaf,
    jsonable,
)
from core.tree import Tree, get, is_section, leaves, shown, spelt

# The preset names, as stages/presets registers them when it is imported: core sits below the
# presets and names none. For the layers below the stages, which cannot import them
# (shards.manifest tells a run root named after a preset by it).
PRESET_NAMES: list[str] = []


def register_preset_names(names: Sequence[str]) -> None:
    PRESET_NAMES[:] = names


class ConfigError(ValueError):
    """Unknown preset, field or bad value. The CLI prints it as one line and exits 2."""


# What config.json holds (an output's identity, which a rerun is compared on) is said once, at each
# field (core.codec.encode reads it): every field, unless its default says `not_recorded` (how or
# where an output is made, not what it holds), `recorded_off_default` (a field added after
# outputs were written: theirs keep their bytes and resume) or `recorded_along` (recorded
# exactly when another field is: an option of that one).


def not_recorded(default: Any) -> Any:
    return dataclasses.field(default=default, metadata={IDENTITY: SKIP})


def recorded_off_default(default: Any) -> Any:
    return dataclasses.field(default=default, metadata={IDENTITY: OFF_DEFAULT})


def recorded_along(default: Any, other: str) -> Any:
    return dataclasses.field(default=default, metadata={IDENTITY: ALONG, ALONG: other})


@dataclass(frozen=True)
class StageConfig(metaclass=Tree):
    """Fields every stage shares: where the run root is and the seed everything derives from.
    `preset` is what --preset named (`resolve` sets it; stages/presets holds every preset).
    A stage's own fields are leaves and typed sections (core/tree.py); `LEGACY` maps the names
    its config.json records onto their paths (stages/configs/legacy.py; core/codec.py reads it)."""

    LEGACY: ClassVar[dict[str, str]] = {}
    # leaves that name a folder under the runs root (a root, a run): plain names, checked by
    # `resolve` for every stage (check_plain_name); a stage adds its own
    FOLDER_NAMES: ClassVar[tuple[str, ...]] = ("name",)

    preset: str = ""
    out: str = not_recorded("runs")  # parent of every run root
    # run root folder name; defaults to the preset
    # (or the classes-file stem)
    name: str = not_recorded("")
    classes_file: str = ""  # custom dataset: a text file with one class name per line
    seed: int = 0
    # torch intra-op threads on a CPU-only machine; 0 = torch's default. CPU kernels (oneDNN)
    # can depend on the thread count, so stages whose bytes must not depend on how they were
    # launched pin it (generate, annotate: 1).
    cpu_threads: int = 0
    # hash every shard read against its manifest's sha256 (sizes and counts are always checked);
    # 0 skips the hash for storage you trust. Not part of an output's identity.
    verify_sha256: bool = not_recorded(True)

    def check_leaves(self) -> None:
        """The ranges its `bounded` leaves declare (core.tree.Tree calls it on every config it
        builds, after the dataclasses' own checks)."""
        check_bounds(self)

    @property
    def root(self) -> Path:
        """runs/<classes>/: the folder all stages of one dataset share."""
        return Path(self.out) / (self.name or self.preset)

    def to_dict(self) -> dict[str, Any]:
        """Every leaf under the name config.json records it by (core.codec.every_leaf)."""
        return every_leaf(self)

    def recorded(self) -> Recorded:
        """What the stage writes as its config.json (core.codec.encode)."""
        return encode(self)


def every_field(config: Any) -> dict[str, Any]:
    """Every field of a config as its tree, default-valued ones included: what --print-config
    shows, so it agrees with --fields (config.json, `recorded`, leaves some out)."""
    found = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        found[f.name] = every_field(value) if is_section(type(value)) else jsonable(value)
    return found


def did_you_mean(word: str, choices: Iterable[Any], spell: Callable[[str], str] = str) -> str:
    """The words "did you mean 'x'? " for the choice `word` most likely meant (difflib; case
    aside, so `Digits` finds `digits`), spelt as the command line takes it; "" for none."""
    by_lower = {str(c).lower(): str(c) for c in choices}
    close = difflib.get_close_matches(str(word).lower(), by_lower, n=1)
    return f"did you mean {spell(by_lower[close[0]])!r}? " if close else ""


# While `field_choices` builds a config, check_choice records each field's choices here: the
# choices live in the one place that checks them, and --fields / --help read them from there.
_RECORDED_CHOICES: ContextVar[dict[str, tuple[Any, ...]] | None] = ContextVar(
    "semix_recorded_choices", default=None
)


def check_choice(field: str, value: Any, choices: Sequence[Any]) -> None:
    recorded = _RECORDED_CHOICES.get()
    if recorded is not None:
        recorded[field] = tuple(choices)
    if value not in choices:
        shown = ", ".join('"" (empty)' if c == "" else str(c) for c in choices)
        raise ConfigError(
            f"{field}={value!r} is not valid; {did_you_mean(value, choices)}choose one of: {shown}"
        )


def field_choices(config_cls: type, values: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
    """{field: its choices} as the config's own checks declare them (`check_choice`), recorded
    while a config of `values` is built: so they are the choices that apply to it (generate's
    samplers follow its backend). Values that make no valid config give the choices checked
    before the one that failed."""
    recorded: dict[str, tuple[Any, ...]] = {}
    token = _RECORDED_CHOICES.set(recorded)
    try:
        with contextlib.suppress(ValueError, TypeError):  # ConfigError is a ValueError
            config_cls(**values)
    finally:
        _RECORDED_CHOICES.reset(token)
    return recorded


def check_range(
    field: str,
    value: float,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """`value` within [low, high] (an `_open` end excluded: `(0.0, inf)`), and finite: a NaN
    compares False with every bound, so without the explicit check `lr=nan` passed any range
    and trained to NaN."""
    bounds = (  # an infinite end is never allowed: `)`
        f"{'(' if low_open or low is None else '['}{'-inf' if low is None else low}, "
        f"{'inf' if high is None else high}{')' if high_open or high is None else ']'}"
    )
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{field}={value!r} is not a finite number; allowed: {bounds}")
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        raise ConfigError(f"{field}={value!r} is out of range {bounds}")


# A numeric field's allowed range, said at the field (`bounded`): every config built checks its
# leaves' ranges (`check_bounds`, called by core.tree.Tree once the config is built), so a stage
# gets the check by declaring the field, and the error names the leaf by its path (`optim.lr`).
BOUNDS = "bounds"


def bounded(
    default: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> Any:
    """A numeric field with its allowed range (check_range: finite, an `_open` end excluded)."""
    bounds = {"low": low, "high": high, "low_open": low_open, "high_open": high_open}
    return dataclasses.field(default=default, metadata={BOUNDS: bounds})


def check_bounds(config: Any) -> None:
    """Every `bounded` leaf of a built config within its range; the first that is not is one
    ConfigError naming the leaf as --set spells it (its path)."""
    for leaf in leaves(type(config)):
        bounds = leaf.field.metadata.get(BOUNDS)
        if bounds is not None:
            check_range(shown(type(config), leaf.path), get(config, leaf.path), **bounds)


def _coerce(field: str, text: str, annotation: Any) -> Any:
    """Parse a --set value according to the field's type annotation."""
    origin, words = typing.get_origin(annotation), []
    if origin in (typing.Union, types.UnionType):
        # `float | Literal["auto"]`: a word of the Literal as it is, else the other type;
        # `int | None`: "none"/"" -> None, else the first non-None type
        arms = [a for a in typing.get_args(annotation) if a is not type(None)]
        words = [w for a in arms if typing.get_origin(a) is Literal for w in typing.get_args(a)]
        if text in words:
            return text
        if len(arms) < len(typing.get_args(annotation)) and text.lower() in ("none", "null", ""):
            return None
        annotation = next(a for a in arms if typing.get_origin(a) is not Literal)
        origin = typing.get_origin(annotation)
    if origin is tuple:
        args = typing.get_args(annotation)
        elem = args[0] if args else str
        parts = [p for p in text.split(",") if p.strip()] if text else []
        return tuple(_coerce(field, p.strip(), elem) for p in parts)
    try:
        if annotation is bool:
            lowered = text.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if annotation is int:
            return int(text)
        if annotation is float:
            return float(text)
    except ValueError:
        name = getattr(annotation, "__name__", str(annotation))
        name += "".join(f" or {w!r}" for w in words)  # float | Literal["auto"]: "... or 'auto'"
        raise ConfigError(f"{field}={text!r} is not a valid {name}") from None
    return text


def parse_sets(
    config_cls: type, sets: Sequence[str], spell: Callable[[str], str] = str, known=None
) -> dict[str, Any]:
    """--set values -> {field: typed value}; a later value of a field wins. `spell(field)` is how
    the command line names a field (a chain: `generate.steps`), for the error messages. A
    config's SECTIONS spell dotted keys (`loss.gamma=2`; `known`: the preset's values)."""
    hints = {leaf.path: leaf.hint for leaf in leaves(config_cls)}
    valid = list(hints)
    known = {spelt(config_cls, k): v for k, v in (known or {}).items()}
    for section in getattr(config_cls, "SECTIONS", ()):
        sets = section.unnest(sets, known, spell)
    values: dict[str, Any] = {}
    for item in sets:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        path = spelt(config_cls, key)
        if path not in valid:
            raise ConfigError(_unknown_field(config_cls, key, valid, spell))
        if key in getattr(config_cls, "LEGACY", {}):
            renamed(key, spell(key), spell(path))
        values[path] = _coerce(spell(path), text, hints[path])
    return values


class RenamedField(FutureWarning):
    """A flat --set spelling that names a leaf of the config tree now: still taken, and said
    once per spelling (the CLI prints the message alone, pipeline/cli.py)."""


# the flat names said in this process (a chain resolves a step's config more than once)
SAID: set[str] = set()


def renamed(name: str, old: str, new: str) -> None:
    """Say that the flat name `name` (spelt `old` on this command line) is `new` now, once."""
    if name not in SAID:
        SAID.add(name)
        warnings.warn(f"{old} is now {new}", RenamedField, stacklevel=2)


def _unknown_field(
    config_cls: type, key: str, valid: Sequence[str], spell: Callable[[str], str]
) -> str:
    """A misspelt key gets the field it was likely meant for (its path, when it is near a flat
    name), not a list of every field (train has 52); with no close one, the list is the help
    there is."""
    names = [
        *dict.fromkeys(shown(config_cls, p) for p in valid),
        *getattr(config_cls, "LEGACY", {}),
    ]
    guess = did_you_mean(key, names, lambda k: spell(shown(config_cls, spelt(config_cls, k))))
    if guess:
        return f"unknown field {spell(key)!r}; {guess}(--fields lists all {len(valid)})"
    return f"unknown field {spell(key)!r}; valid fields: {', '.join(map(spell, valid))}"


C = TypeVar("C", bound=StageConfig)


class Presets(Protocol):
    """A stage's presets (stages/presets builds them): what a --preset value gives the stage."""

    def lookup(self, preset: str) -> tuple[str, dict[str, Any]]:
        """(the preset's name, the stage's field values it sets: a `when` entry included);
        a ConfigError for a preset that does not exist."""
        ...


def resolve(
    config_cls: type[C],
    presets: Presets,
    preset: str,
    sets: Sequence[str] = (),
    spell: Callable[[str], str] = str,
) -> C:
    """defaults < preset < --set. `preset`: whatever --preset takes (stages/presets: a name, a
    class-names text file, DATA+RECIPE). `spell`: how the command line names a field
    (parse_sets)."""
    preset, values = presets.lookup(preset)
    when = values.pop("when", {})
    values = {spelt(config_cls, k): v for k, v in values.items()}  # presets' flat names
    sets_values = parse_sets(config_cls, sets, spell, values)
    # "when": {"backend=edm": {...}} = preset values that apply when that field (after --set)
    # has that value, e.g. the paper's steps once `--set backend=edm` picks its generator
    for condition, overrides in when.items():
        field, _, value = condition.partition("=")
        field = spelt(config_cls, field)
        if str(sets_values.get(field, values.get(field))) == value:
            values.update({spelt(config_cls, k): v for k, v in overrides.items()})
    values.update(sets_values)
    values["preset"] = preset
    # a default that follows another field (train's run: its loss), filled before the frozen
    # config is built, so no config changes after creation
    values = getattr(config_cls, "fill_defaults", lambda v: v)(values)
    try:
        config = config_cls(**values)
    except TypeError as e:  # a preset naming a field the dataclass lacks: a bug, say so
        raise ConfigError(f"{config_cls.__name__}: {e}") from e
    for path in config_cls.FOLDER_NAMES:
        value = get(config, path)
        for one in value if isinstance(value, tuple) else (value,):
            check_plain_name(spell(shown(config_cls, path)), one)
    if not str(config.out).strip():  # `out=` would put every run root in the working folder
        raise ConfigError(
            f"{spell('out')}= is empty: set it to the folder that holds the run roots "
            "(default: runs)"
        )
    return config


def check_plain_name(field: str, value: str) -> None:
    """A folder-name field (`name=`, `run=`, ...) names one folder under the runs root: no
    path separator, not `.` or `..`, not hidden (readers skip hidden folders), so that an
    output never lands outside its root. "" (the field's default: the preset, the loss) is
    left to the stage."""
    if not value:
        return
    if "/" in value or "\\" in value or "\0" in value or value.startswith("."):
        plain = "".join(c for c in Path(value.replace("\\", "/")).name if c != "\0").lstrip(".")
        example = f" (e.g. {field}={plain})" if plain else ""
        elsewhere = "; to write elsewhere, set out= to the folder of the run roots"
        raise ConfigError(
            f"{field}={value!r} must be a plain folder name: no '/', not starting with '.'"
            f"{example}{elsewhere if field.rpartition('.')[2] == 'name' else ''}"
        )


def given_folder(field: str, value: str, hint: str) -> Path:
    """The path a `field=` names (mixed=, series=, model=), which must exist: a mistyped path is
    named as missing, never answered with the command that makes the run root's own folder."""
    if not Path(value).exists():
        raise ConfigError(f"{field}={value}: no such file or folder; {hint}")
    return Path(value)


def set_value(value: Any) -> str:
    """A value as `--set key=...` spells it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return ",".join(map(str, value)) or '""'
    if value is None:
        return "none"
    return str(value) or '""'
