"""`semix --help` and `semix <stage> --help`: what a stage or command is for, how to call it,
its fields (defaults, the preset's values, descriptions, choices), the presets and examples.

Everything is read from the code, never from a second copy that could drift: the purpose and
the examples from the module docstring (read from the source: help imports no stage, so it
is as quick as --fields), the fields from the config class (`core.fielddocs.describe_fields`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
from pathlib import Path

from core.config import StageConfig
from core.fielddocs import describe_fields
from pipeline.chain import SHARED_FIELDS
from pipeline.registry import COMMANDS, STAGES, config_module
from stages import presets
from stages.presets import DEFAULT, chain_steps

USAGE = "[--preset NAME] [--set KEY=VALUE ...] [--fields | --print-config | --help]"
EXAMPLES = 2


def presets_line() -> str:
    """Read when help is asked for: a plugin's presets are among them (pipeline/plugins.py)."""
    return (
        f"presets (--preset): {', '.join(presets.NAMES)} (default: {DEFAULT}), or a .txt "
        "file with one class name per line (a custom dataset); --recipe NAME: that preset's "
        "recipe on --preset's data"
    )


def module_docstring(module: str) -> str:
    """A module's docstring, read from its source without importing it (a stage module pulls in
    torch and its models)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return ""
    return ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))) or ""


def module_of(name: str) -> str:
    return COMMANDS[name] if name in COMMANDS else STAGES[name].module


def purpose(name: str) -> str:
    """The first paragraph of the docstring, without its own `name:` or `` `make x`: `` lead."""
    first = module_docstring(module_of(name)).split("\n\n", 1)[0]
    return re.sub(r"^(`[^`]+`|[\w-]+):\s+", "", " ".join(first.split()))


def examples(name: str) -> list[str]:
    """Two command lines: the docstring's own (`... -m pipeline <name> ...`), else made up: a
    command's run on the default preset; for a stage only lines that always run (a made-up run
    could lack what the stage needs, such as pull's repo=)."""
    own = [
        line.strip()
        for line in module_docstring(module_of(name)).splitlines()
        if re.search(rf"-m pipeline {re.escape(name)}(\s|$)", line)
    ]
    describe = f"python -m pipeline {name} --preset {DEFAULT} --print-config"
    made = [f"{describe}   # what it would run; runs nothing"]
    if name in COMMANDS:
        made.insert(0, f"python -m pipeline {name} --preset {DEFAULT}")
    else:
        made.append(f"python -m pipeline {name} --fields   # every field; runs nothing")
    return [*own, *made][:EXAMPLES]


def overview() -> str:
    """The stages and commands, one line each: `semix --help`'s epilog."""
    width = max(map(len, [*STAGES, *COMMANDS])) + 2
    lines = ["stages, in the order a dataset goes through them (semix <stage> --help):"]
    lines += [f"  {name.ljust(width)}{purpose(name)}" for name in STAGES]
    lines += ["", "commands, several stages in one go (semix <command> --help):"]
    lines += [f"  {name.ljust(width)}{purpose(name)}" for name in COMMANDS]
    return "\n".join(lines)


def stage_help(stage: str, preset: str) -> str:
    """`semix <stage> --help`: purpose, usage, examples, presets, then the fields in two groups,
    the stage's own and those every stage shares."""
    cfg_mod = config_module(stage)
    shared = [f.name for f in dataclasses.fields(StageConfig)]
    own = [f.name for f in dataclasses.fields(cfg_mod.Config) if f.name not in shared]
    rows = {
        group: describe_fields(cfg_mod.Config, cfg_mod.PRESETS, preset, skip=skip)
        for group, skip in (("own", shared), ("shared", own))
    }
    return "\n".join([
        *_head(stage),
        f"{stage}'s fields (--set key=value; a preset's column shows where --preset {preset} "
        "differs from the default):",
        *rows["own"],
        "",
        "fields every stage shares:",
        *rows["shared"],
        "",
        "--fields lists them in one table; --print-config shows the resolved config (neither "
        "runs anything).",
    ])  # fmt: skip


def command_help(command: str, preset: str) -> str:
    """`semix chain|demo|study --help`: purpose, usage, examples, presets, the chain's steps for
    this preset and how its --set keys are scoped."""
    steps = [  # an unknown preset is refused here too
        f"{stage} ({' '.join(extra)})" if extra else stage for stage, extra in chain_steps(preset)
    ]
    chain = f"the chain for --preset {preset}: {' -> '.join(steps)}"
    if command != "chain":  # demo and study run the chain first, then their runs
        chain = f"first {chain}; then its own train, finetune and evaluate runs"
    study = ", the study's own as study.key=value (study.seeds=0,1)" if command == "study" else ""
    return "\n".join([
        *_head(command),
        chain,
        "",
        f"fields: the ones every stage shares as key=value ({', '.join(SHARED_FIELDS)}), one "
        f"stage's as <stage>.key=value (generate.sample_steps=15){study}; "
        f"`semix {command} --fields` lists them all, --print-config shows what would run "
        "(neither runs anything).",
    ])  # fmt: skip


def _head(name: str) -> list[str]:
    """What every help starts with: purpose, usage, examples, presets."""
    return [
        f"semix {name}: {purpose(name)}",
        "",
        f"usage: semix {name} {USAGE}",
        "",
        "examples:",
        *(f"  {line}" for line in examples(name)),
        "",
        presets_line(),
        "",
    ]


def help_text(name: str, preset: str) -> str:
    """`semix <name> --help` for a stage or a command."""
    return command_help(name, preset) if name in COMMANDS else stage_help(name, preset)
