"""The stage registry: stage name -> its `StageSpec` (config module, stage module, what it
writes), found by name. One registration says everything about a stage: `register_stage`, for
the built-in stages below and for a stage of your own from a plugin module (SEMIX_PLUGINS,
pipeline/plugins.py; docs/contributing.md "Add a stage").

The app (cli, chain, demo, study, bench) runs stages through `run_stage`; stages never import
each other or this module, so the app sits on top of them without an import cycle.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config import ConfigError, resolve
from core.fielddocs import describe_fields
from core.launch import check_launcher, cpu_threads, launch_world, run_launched
from core.version import code_version
from shards.manifest import register_outputs
from shards.reader import hash_on_read

# whole runs of several stages: command -> its module (pipeline/cli.py runs them); no stage
# may take their names
COMMANDS = {"chain": "pipeline.chain", "demo": "pipeline.demo", "study": "pipeline.study"}


@dataclass(frozen=True)
class StageSpec:
    """A stage: the modules the app loads by name (the config one is light: resolving a config,
    --fields or a chain's plan never imports the stage's models), and what it writes, so a
    missing or damaged output names the command that rewrites it (shards.manifest)."""

    name: str  # on the command line: `python -m pipeline <name>`
    config: str  # module with `Config` (a frozen StageConfig) and `PRESETS`
    module: str  # module with `run(cfg) -> Path`; its docstring's first line is --help's purpose
    main_only: bool = False  # one writer, no rank split: under a launcher only global rank 0 runs
    folder: str = ""  # it writes runs/<classes>/<folder>
    parent: str = ""  # it writes runs/<classes>/<parent>/<one of several>
    kind: str = ""  # the `kind` of its manifest


# stage name -> its spec, in the order a dataset goes through them (`semix --help` lists them so)
STAGES: dict[str, StageSpec] = {}


def register_stage(
    name: str,
    config: str,
    module: str,
    *,
    main_only: bool = False,
    folder: str = "",
    parent: str = "",
    kind: str = "",
) -> StageSpec:
    """Add a stage: `python -m pipeline <name>` then runs `module.run`, --help and --fields
    describe it, the chain's `<name>.key=value` scopes reach it. Modules are named, not
    imported, until the stage is used. A plugin registers when SEMIX_PLUGINS imports it."""
    if not re.fullmatch(r"[a-z][a-z0-9-]*", name) or name in STAGES or name in COMMANDS:
        raise ValueError(f"stage name {name!r} is taken or not a plain lower-case name")
    spec = StageSpec(name, config, module, main_only, folder, parent, kind)
    STAGES[name] = spec
    register_outputs(name, folder=folder, parent=parent, kind=kind)
    return spec


def _builtin(name: str, **spec: Any) -> None:
    """A stage of semix: its modules are stages/configs/<name>.py and stages/<name>.py."""
    module = name.replace("-", "_")
    register_stage(name, f"stages.configs.{module}", f"stages.{module}", **spec)


# the built-in stages, in the order a dataset goes through them: what each writes in a runs root
_builtin("prepare", main_only=True, parent="real", kind="real")  # real/{train,val,test}
_builtin("fit-generator", folder="generator", kind="generator")
_builtin("generate", folder="series", kind="series")
_builtin("annotate", folder="mixed", kind="mixed")
_builtin("train", parent="train", kind="run")  # train/<run>
_builtin("evaluate")  # eval/<stage>/<run> (shards/evals.py names its own reruns)
_builtin("finetune", parent="finetune", kind="run")  # finetune/<run>-<objective>
_builtin("publish", main_only=True)  # to the Hub
_builtin("pull", main_only=True, folder="mixed", kind="mixed")  # runs/<repo>/mixed
_builtin("convert-edm", main_only=True, folder="edm")  # edm/: weights + config, no manifest
_builtin("shift", main_only=True, parent="shift", kind="corruptions")  # shift/test-c
_builtin("ood", main_only=True, parent="ood", kind="ood")  # ood/<set>


def _import(stage: str, which: str):
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; choose one of: {', '.join(STAGES)}")
    name = getattr(STAGES[stage], which)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        if name.startswith("stages."):
            raise ConfigError(f"stage {stage!r} is not available in this version of semix") from e
        raise ConfigError(
            f"stage {stage!r}: no module {name!r} to import; put its folder on PYTHONPATH"
        ) from e


def config_module(stage: str):
    """The module of a stage's Config and PRESETS (light: resolving a config, --fields or a
    chain's plan never imports the stages' models, diffusers among them)."""
    return _import(stage, "config")


def stage_modules(stage: str):
    """(config module, stage module) for a stage name."""
    return config_module(stage), _import(stage, "module")


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


def run_train_stack(preset: str, sets_per_run: Sequence[Sequence[str]]) -> list[Path]:
    """train's runs that differ only by `seed=` (and `run=`), trained together in one process
    (stages.train.run_stack: the data read once, each run's folder as `run_stage` makes it);
    their folders, in order. Under a launcher the runs go one by one through `run_stage`."""
    cfg_mod, run_mod = stage_modules("train")
    configs = [resolve(cfg_mod.Config, cfg_mod.PRESETS, preset, sets) for sets in sets_per_run]
    for config in configs:
        check_out(config)
    check_launcher()
    if launch_world() > 1:
        return [run_stage("train", preset, sets) for sets in sets_per_run]
    run_mod.check_stack(configs)  # one cpu_threads and verify_sha256 for all
    with cpu_threads(configs[0].cpu_threads), hash_on_read(configs[0].verify_sha256):
        return run_mod.run_stack(configs)


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
            main_only=STAGES[stage].main_only,
        )
