"""The stage registry: stage name -> (its config module, its stage module), found by name.

The app (cli, chain, demo, study, bench) runs stages through `run_stage`; stages never import
each other or this module, so the app sits on top of them without an import cycle.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

from core.config import ConfigError, describe_fields, resolve
from core.runtime import (
    check_launcher,
    code_version,
    cpu_threads,
    launch_world,
    run_launched,
)
from shards.reader import hash_on_read

# stage name on the command line -> module under stages/configs/ and stages/
STAGES = {
    "prepare": "prepare",
    "fit-generator": "fit_generator",
    "generate": "generate",
    "annotate": "annotate",
    "train": "train",
    "evaluate": "evaluate",
    "finetune": "finetune",
    "publish": "publish",
    "pull": "pull",
    "convert-edm": "convert_edm",
    "shift": "shift",
    "ood": "ood",
}

# stages with one writer and no rank split: under a launcher they run on global rank 0 only
MAIN_ONLY = ("prepare", "publish", "pull", "convert-edm", "shift", "ood")


def _import(stage: str, package: str):
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; choose one of: {', '.join(STAGES)}")
    name = f"{package}.{STAGES[stage]}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            raise ConfigError(f"stage {stage!r} is not available in this version of semix") from e
        raise


def config_module(stage: str):
    """The module of a stage's Config and PRESETS (light: resolving a config, --fields or a
    chain's plan never imports the stages' models, diffusers among them)."""
    return _import(stage, "stages.configs")


def stage_modules(stage: str):
    """(config module, stage module) for a stage name."""
    return config_module(stage), _import(stage, "stages")


def resolve_stage_config(
    stage: str, preset: str, sets: Sequence[str] = (), spell: Callable[[str], str] = str
):
    """The stage's config: defaults < preset < --set. `spell(field)`: how the command line names
    a field, for the errors (a chain: `<stage>.key`)."""
    cfg_mod = config_module(stage)
    return resolve(cfg_mod.Config, cfg_mod.PRESETS, preset, sets, spell)


def describe_stage(stage: str, preset: str) -> str:
    """`semix <stage> --fields`: every field with its default, the preset's value where it
    differs, and its description (the comment next to the field in the source)."""
    cfg_mod = config_module(stage)
    rows = describe_fields(cfg_mod.Config, cfg_mod.PRESETS, preset)
    return "\n".join([f"semix {stage} --preset {preset}: --set key=value (repeatable)", *rows])


def check_out(config) -> None:
    """The run root must be a folder (or creatable as one): refuse out= naming a file up front."""
    for path in (config.root, *config.root.parents):
        if path.exists():
            if not path.is_dir():
                raise ConfigError(f"out={config.out}: {path} is a file, not a folder; set out=")
            return


def run_stage(stage: str, preset: str, sets: Sequence[str] = ()):
    cfg_mod, run_mod = stage_modules(stage)
    config = resolve(cfg_mod.Config, cfg_mod.PRESETS, preset, sets)
    check_out(config)
    check_launcher()
    with cpu_threads(config.cpu_threads), hash_on_read(config.verify_sha256):
        if launch_world() == 1:
            return run_mod.run(config)
        # torchrun / accelerate launch, any number of nodes: the ranks must agree on everything
        # but where the root is mounted (`out`, checked by a file instead), code included
        fields = {k: v for k, v in config.to_dict().items() if k != "out"}
        fields["code_version"] = code_version()
        return run_launched(
            lambda: run_mod.run(config),
            fields,
            config.root,
            device=getattr(config, "device", ""),
            main_only=stage in MAIN_ONLY,
        )
