"""Every preset, in one place: a dataset and a recipe for it (one module each, `base.Preset`).

What `--preset` names:
- a preset: `digits` (the default), `fashion-mnist`, `cifar10`, ...;
- a classes .txt file (one class name per line): `imagefolder` with those classes, its run root
  named after the file;
- `DATA+RECIPE` (what `--preset DATA --recipe RECIPE` passes on): DATA's data with RECIPE's
  recipe, i.e. every stage value and the chain of RECIPE except the data source fields
  (`DATA_FIELDS`), and what DATA knows of its data. Its run root is named `DATA+RECIPE`, so two
  recipes on the same data never share one. `make study CLASSES=imagefolder RECIPE=fashion-mnist`
  runs the study's fair in-house chain on your own small images.

A preset may extend another (`Preset.extends`: cifar100 starts from cifar10's recipe). A stage
config reads its values through `stage_presets(stage)` (its module's `PRESETS`); prepare reads
its data through `reader(source)`. Adding a preset: a module here with its `PRESET`, and the
module in `_MODULES`; or, from your own module, `register_preset(PRESET)` (pipeline/plugins.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from core.config import ConfigError, did_you_mean, register_preset_names
from stages.presets import (
    cifar10,
    cifar100,
    digits,
    fashion_mnist,
    imagefolder,
    imagenet,
    tiny_imagenet,
)
from stages.presets.base import DEFAULT_CHAIN, Preset, Step

_MODULES = (digits, fashion_mnist, cifar10, cifar100, tiny_imagenet, imagefolder, imagenet)
PRESETS: dict[str, Preset] = {m.PRESET.name: m.PRESET for m in _MODULES}
NAMES = tuple(PRESETS)  # in the order --help lists them
DEFAULT = digits.PRESET.name  # what a command line without --preset runs (the CLI says so once)
CLASSES_FILE = imagefolder.PRESET.name  # what a classes .txt file is a preset of
RECIPE_MARK = "+"  # DATA+RECIPE
# the fields that say where a preset's data come from: DATA+RECIPE takes them from DATA
DATA_FIELDS: dict[str, tuple[str, ...]] = {"prepare": ("source", "data_dir", "hf_dataset")}
# presets whose real images are also a far-OOD test set for the others (the ood stage builds
# them: scikit-learn's 1,797 real handwritten digits resized to the root's image size)
FAR_OOD_SETS = (digits.PRESET.name,)
# the sources prepare reads (`source=`): every preset that reads data of its own
SOURCES = tuple(name for name, p in PRESETS.items() if p.reads is not None)

register_preset_names(NAMES)  # for the layers below, which cannot import this package


def register_preset(preset: Preset) -> None:
    """Add a preset from your own module (docs/contributing.md): `--preset <name>` then runs
    it. Register when the module is imported, which SEMIX_PLUGINS does before any config is
    built (pipeline/plugins.py); `extends` may name any preset registered before it."""
    global NAMES, SOURCES
    if preset.name in PRESETS or RECIPE_MARK in preset.name or preset.name.endswith(".txt"):
        raise ValueError(f"preset name {preset.name!r} is taken or not a plain name")
    if preset.extends and preset.extends not in PRESETS:
        raise ValueError(f"preset {preset.name!r} extends {preset.extends!r}, which is no preset")
    PRESETS[preset.name] = preset
    NAMES = tuple(PRESETS)
    SOURCES = tuple(name for name, p in PRESETS.items() if p.reads is not None)
    register_preset_names(NAMES)


@functools.cache
def resolved(name: str) -> Preset:
    """The preset `name` (a name, or DATA+RECIPE of two names) with what it extends folded in."""
    if name not in PRESETS:
        data, mark, recipe = name.rpartition(RECIPE_MARK)
        if not mark:
            raise KeyError(name)
        return with_recipe(resolved(data), resolved(recipe))
    own = PRESETS[name]
    if not own.extends:
        return own
    base = resolved(own.extends)
    stages = {s: dict(v) for s, v in base.stages.items()}
    for stage, values in own.stages.items():
        stages[stage] = {**stages.get(stage, {}), **values}
    chain = own.chain if own.chain is not None else base.chain
    return Preset(**{**vars(own), "stages": stages, "chain": chain, "extends": ""})


def with_recipe(data: Preset, recipe: Preset) -> Preset:
    """`data`'s data, `recipe`'s recipe: every stage value of the recipe but the data source
    fields, which are the data preset's (a field it leaves at the default is left there)."""
    stages = {s: dict(v) for s, v in recipe.stages.items()}
    for stage, names in DATA_FIELDS.items():
        kept = {k: v for k, v in stages.get(stage, {}).items() if k not in names}
        stages[stage] = kept | {k: v for k, v in data.stages.get(stage, {}).items() if k in names}
    return Preset(
        name=f"{data.name}{RECIPE_MARK}{recipe.name}",
        stages=stages,
        chain=recipe.chain,
        reads=data.reads,
        reads_fields=data.reads_fields,
        edm_checkpoint=data.edm_checkpoint,
        data_license=data.data_license,
    )


def _known(name: str, what: str) -> str:
    """`name`, if it is a preset; else a one-line ConfigError naming the likely one."""
    if name not in PRESETS:
        files = " (or a .txt file with one class name per line)" if what == "preset" else ""
        raise ConfigError(
            f"unknown {what} {name!r}; {did_you_mean(name, NAMES)}choose one of: "
            f"{', '.join(NAMES)}{files}"
        )
    return name


def lookup(preset: str) -> tuple[Preset, dict[str, Any]]:
    """(the preset a --preset value names, the fields its spelling sets: a classes file's
    `name` and `classes_file`); unknown names and missing files are refused."""
    if preset not in PRESETS and not preset.endswith(".txt") and RECIPE_MARK in preset:
        data, _, recipe = preset.rpartition(RECIPE_MARK)
        base, values = lookup(data)
        if RECIPE_MARK in base.name:
            raise ConfigError(f"--preset {preset}: give one recipe (DATA{RECIPE_MARK}RECIPE)")
        chosen = resolved(f"{base.name}{RECIPE_MARK}{_known(recipe, 'recipe')}")
        if "name" in values:  # a classes file: its root is named after the file, then the recipe
            values["name"] = f"{values['name']}{RECIPE_MARK}{recipe}"
        return chosen, values
    if preset not in PRESETS and Path(preset).suffix == ".txt":
        if not Path(preset).is_file():
            raise ConfigError(f"classes file {preset} does not exist")
        return resolved(CLASSES_FILE), dict(name=Path(preset).stem, classes_file=preset)
    return resolved(_known(preset, "preset")), {}


def compose(preset: str, recipe: str | None) -> str:
    """What `--preset PRESET --recipe RECIPE` names: PRESET+RECIPE (checked); PRESET alone
    without a recipe."""
    if not recipe:
        return preset
    composed = f"{preset}{RECIPE_MARK}{recipe}"
    lookup(composed)
    return composed


class StagePresets(Mapping[str, Mapping[str, Any]]):
    """One stage's values of every preset: what `stages/configs/<stage>.py` calls `PRESETS`,
    and what core.config.resolve reads through `lookup`."""

    def __init__(self, stage: str):
        self.stage = stage

    def __getitem__(self, name: str) -> Mapping[str, Any]:
        return dict(lookup(name)[0].stages.get(self.stage, {}))

    def __iter__(self) -> Iterator[str]:
        return iter(NAMES)

    def __len__(self) -> int:
        return len(NAMES)

    def lookup(self, preset: str) -> tuple[str, dict[str, Any]]:
        """(the preset's name, the fields a --preset value gives this stage)."""
        chosen, values = lookup(preset)
        return chosen.name, {**values, **chosen.stages.get(self.stage, {})}


def stage_presets(stage: str) -> StagePresets:
    return StagePresets(stage)


def chain_steps(preset: str) -> list[Step]:
    """The steps of the chain (`make chain`) of a --preset value."""
    chain = lookup(preset)[0].chain
    return list(DEFAULT_CHAIN if chain is None else chain)


def reads_fields(source: str) -> tuple[str, ...]:
    """The prepare fields `source=`'s reader reads (where its data come from)."""
    return PRESETS[source].reads_fields


def unread_fields(source: str, values: dict[str, Any]) -> list[str]:
    """The prepare fields among `values` (those set) that `source=`'s reader never reads."""
    return [k for k, v in values.items() if v and k not in PRESETS[source].reads_fields]


def reader(source: str) -> Callable[[Any], Any]:
    """prepare's reader of `source=`: (its config) -> shards.sources.Source."""
    read = PRESETS[source].reads
    assert read is not None, source  # the prepare config checks `source` against SOURCES
    return read


def edm_checkpoint(preset: str) -> str:
    """Where the paper's EDM network for the preset's classes is published; "" if nowhere."""
    return lookup(preset)[0].edm_checkpoint


def data_license(preset: str) -> tuple[str, str] | None:
    """(Hub license id, what the data is) of the preset's data, where it is known."""
    return lookup(preset)[0].data_license
