"""Typed stage configs, named presets and `--set key=value` overrides.

Each stage has one frozen dataclass in `stages/configs/<stage>.py` deriving from
`StageConfig`, plus a `PRESETS` dict mapping a preset name to the field values that
differ from the dataclass defaults. Resolution order: dataclass defaults < preset <
`--set`. A preset may hold `when={"field=value": {...}}`: values that apply only when the field
resolves to that value. The resolved config is what a stage writes into its folder as config.json.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

PRESET_NAMES = (
    "digits", "fashion-mnist", "cifar10", "cifar100", "tiny-imagenet", "imagefolder", "imagenet",
)  # fmt: skip


class ConfigError(ValueError):
    """Unknown preset, field or bad value. The CLI prints it as one line and exits 2."""


@dataclass(frozen=True)
class StageConfig:
    """Fields every stage shares: where the run root is and the seed everything derives from."""

    preset: str = "digits"
    out: str = "runs"  # parent of every run root
    name: str = ""  # run root folder name; defaults to the preset (or the classes-file stem)
    classes_file: str = ""  # custom dataset: a text file with one class name per line
    seed: int = 0
    # torch intra-op threads on a CPU-only machine; 0 = torch's default. CPU kernels (oneDNN)
    # can depend on the thread count, so stages whose bytes must not depend on how they were
    # launched pin it (generate, annotate: 1).
    cpu_threads: int = 0
    # hash every shard read against its manifest's sha256 (sizes and counts are always checked);
    # 0 skips the hash for storage you trust. Not part of an output's identity.
    verify_sha256: bool = True

    @property
    def root(self) -> Path:
        """runs/<classes>/: the folder all stages of one dataset share."""
        return Path(self.out) / (self.name or self.preset)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def check_choice(field: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ConfigError(
            f"{field}={value!r} is not valid; choose one of: {', '.join(map(str, choices))}"
        )


def check_range(
    field: str, value: float, low: float | None = None, high: float | None = None
) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise ConfigError(f"{field}={value!r} is out of range {bounds}")


def _coerce(field: str, text: str, annotation: Any) -> Any:
    """Parse a --set value according to the field's type annotation."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        # e.g. `int | None`: "none"/"" -> None, else the first non-None type.
        if text.lower() in ("none", "null", ""):
            return None
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
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
        raise ConfigError(f"{field}={text!r} is not a valid {name}") from None
    return text


def parse_sets(config_cls: type, sets: Sequence[str]) -> dict[str, Any]:
    hints = typing.get_type_hints(config_cls)
    valid = [f.name for f in dataclasses.fields(config_cls)]
    values: dict[str, Any] = {}
    for item in sets:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        if key not in valid:
            raise ConfigError(f"unknown field {key!r}; valid fields: {', '.join(valid)}")
        values[key] = _coerce(key, text, hints[key])
    return values


C = TypeVar("C", bound=StageConfig)


def resolve(
    config_cls: type[C],
    presets: Mapping[str, Mapping[str, Any]],
    preset: str,
    sets: Sequence[str] = (),
) -> C:
    """defaults < preset < --set. `preset` may also be a path to a class-names text file."""
    values: dict[str, Any] = {}
    classes_path = Path(preset)
    if preset not in PRESET_NAMES and classes_path.suffix == ".txt":
        if not classes_path.is_file():
            raise ConfigError(f"classes file {preset} does not exist")
        values.update(name=classes_path.stem, classes_file=str(classes_path))
        preset = "imagefolder"
    if preset not in PRESET_NAMES:
        raise ConfigError(
            f"unknown preset {preset!r}; choose one of: {', '.join(PRESET_NAMES)} "
            "(or a .txt file with one class name per line)"
        )
    chosen = dict(presets.get(preset, {}))
    sets_values = parse_sets(config_cls, sets)
    # "when": {"backend=edm": {...}} = preset values that apply when that field (after --set)
    # has that value, e.g. the paper's steps once `--set backend=edm` picks its generator
    for condition, overrides in chosen.pop("when", {}).items():
        field, _, value = condition.partition("=")
        if str(sets_values.get(field, chosen.get(field))) == value:
            chosen.update(overrides)
    values.update(chosen)
    values.update(sets_values)
    values["preset"] = preset
    try:
        return config_cls(**values)
    except TypeError as e:  # a preset naming a field the dataclass lacks: a bug, say so
        raise ConfigError(f"{config_cls.__name__}: {e}") from e


def read_class_names(path: str | Path) -> tuple[str, ...]:
    """One class name per line; blank lines and '#' comments ignored; duplicates refused."""
    names = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    if not names:
        raise ConfigError(f"classes file {path} lists no class names")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"classes file {path} repeats class names: {', '.join(dupes)}")
    return tuple(names)
