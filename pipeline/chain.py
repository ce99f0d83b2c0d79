"""Whole chains of stages, run one after another in this process.

`chain` is what `make chain` (and the README's `make generate`) runs: everything from the real
dataset to the shareable mixed/ folder, in the steps the preset names (stages/presets).
Each stage resumes on its own (complete shards are skipped), so rerunning a chain after an
interruption only does the missing work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from core.config import ConfigError, StageConfig, every_field, parse_sets
from core.fielddocs import describe_fields
from core.logs import log
from core.tree import leaves, shown, spelt
from pipeline.registry import STAGES, check_out, config_module, resolve_stage_config, run_stage
from shards.manifest import is_complete
from stages.presets import chain_steps

SHARED_FIELDS = ("out", "name", "seed", "classes_file", "verify_sha256")


def field_names(stage: str) -> list[str]:
    """Every leaf path of `stage`'s config tree (`loss` for loss.name: core.tree.shown), every
    shorthand of a section of parts (`encoder.model`: the picked encoder's, core/parts.py) and
    every flat name it still takes."""
    config = config_module(stage).Config
    shorthands = {
        f"{section.name}.{param}": None
        for section in getattr(config, "SECTIONS", ())
        for part in section.names
        for param in section.paths_of(part)
    }
    return [*(shown(config, leaf.path) for leaf in leaves(config)), *shorthands, *config.LEGACY]


def _path(stage: str, name: str) -> str:
    """The leaf path a field name of `stage` spells (a flat name: its path), as --set takes it."""
    config = config_module(stage).Config
    return shown(config, spelt(config, name))


def scoped(stage: str) -> Callable[[str], str]:
    """How a chain's --set names a field of `stage`: shared fields as they are, others
    `<stage>.key`."""
    return lambda key: key if key in SHARED_FIELDS else f"{stage}.{key}"


def split_sets(sets: Sequence[str], stage: str) -> list[str]:
    """The --set values meant for `stage`: shared fields, plus `stage.key=value` ones. An
    unscoped key that is not shared is refused, naming the scoped keys that take it."""
    mine = []
    for item in sets:
        key = item.partition("=")[0]
        scope, dot, _ = key.partition(".")  # train.loss.gamma: train's loss.gamma (core/parts.py)
        if dot and scope == stage:
            mine.append(item[len(scope) + 1 :])
        elif not dot and key in SHARED_FIELDS:
            mine.append(item)
        elif not dot:
            name = key.replace("-", "_")
            owners = [f"{s}.{_path(s, name)}=..." for s in STAGES if name in field_names(s)]
            how = f"scope it: {' or '.join(owners)}" if owners else "no stage has such a field"
            raise ConfigError(
                f"{key!r} is not shared by every stage of the chain; {how} "
                f"(shared: {', '.join(SHARED_FIELDS)})"
            )
    return mine


def scope_fields(message: str, stage: str, fields: Iterable[str]) -> str:
    """`message` with every `key=` and `` `key` `` of `fields` written as the chain takes it,
    `<stage>.key`; a quoted single-stage command (`` `python -m pipeline ...` ``) is kept."""
    names = "|".join(re.escape(f) for f in sorted(fields, key=len, reverse=True))
    if not names:
        return message
    key = re.compile(rf"(?<![\w.\-/])(?:{names})(?==)|(?<=`)(?:{names})(?=`)")
    parts = re.split(r"(`python -m pipeline [^`]*`)", message)
    return "".join(
        part
        if part.startswith("`python -m pipeline")
        else key.sub(lambda m: f"{stage}.{m.group(0)}", part)
        for part in parts
    )


@contextlib.contextmanager
def scoped_errors(stage: str) -> Iterator[None]:
    """Errors of `stage` inside a chain name its fields as the chain's --set takes them
    (`generate.model=<folder>`, not `model=<folder>`, which the chain would refuse)."""
    try:
        yield
    except ValueError as e:
        if len(e.args) == 1 and isinstance(e.args[0], str):
            fields = [f for f in field_names(stage) if f not in SHARED_FIELDS]
            e.args = (scope_fields(e.args[0], stage, fields),)
        raise


def check_chain(preset: str, sets: Sequence[str]) -> None:
    """Resolve every step's config before the first step runs: a misspelt or invalid field fails
    in one line now, not after minutes of the stages before the one it belongs to. Fields
    scoped to stages outside the chain (the demo's train./finetune./evaluate.) are checked by
    name and type; an unknown scope is refused."""
    for key in (item.partition("=")[0] for item in sets):
        scope, dot, _ = key.partition(".")
        if dot and scope not in STAGES:
            raise ConfigError(
                f"{key!r}: unknown stage {scope!r}; choose one of {', '.join(STAGES)}"
            )
    steps = chain_steps(preset)
    for stage, extra in steps:
        with scoped_errors(stage):
            sets_here = [*extra, *split_sets(sets, stage)]
            check_out(resolve_stage_config(stage, preset, sets_here, scoped(stage)))
    in_chain = {stage for stage, _ in steps}
    for stage in sorted(set(STAGES) - in_chain):
        with scoped_errors(stage):
            parse_sets(config_module(stage).Config, split_sets(sets, stage), scoped(stage))


class ChainError(ValueError):
    """A step the chain ran in other processes failed: one line naming it and its exit code."""


# Steps a chain spreads over one process per core on a CPU-only machine: generate pins each
# process to one thread (its bytes must not depend on the launcher) and its bytes do not depend
# on the number of ranks (each series' noise is its own), so one process leaves every other core
# idle. Fashion-MNIST's 5,760 images: 9 min 8 s in two processes, each at one process's rate
# (docs/generate.md, "Speed").
SPREAD = {"generate": "series"}


def cpu_processes() -> int:
    """One process per core this process may use, on a machine without CUDA and outside a
    launcher (which has chosen already); else 1."""
    import torch  # not at import: resolving a chain's config imports no torch

    from core.launch import launch_world

    if launch_world() > 1 or torch.cuda.is_available():
        return 1
    cores = (
        os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    )
    return max(1, len(cores))


def run_step(stage: str, preset: str, sets: Sequence[str]) -> Any:
    """One step of a chain: in this process, or (SPREAD, unfinished, several cores) under
    torchrun with one process per core; returns the step's output folder."""
    n = cpu_processes() if stage in SPREAD else 1
    folder = resolve_stage_config(stage, preset, sets).root / SPREAD.get(stage, "")
    if n == 1 or is_complete(folder):  # complete: the stage only says so
        return run_stage(stage, preset, sets)
    log.info("chain: %s in %d processes (one per core)", stage, n)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
        "-m", "pipeline", stage, "--preset", preset, "--set", *sets,
    ]  # fmt: skip
    rc = subprocess.run(cmd, check=False).returncode
    if rc != 0:
        raise ChainError(f"{stage} in {n} processes failed (exit {rc}); its output is above")
    return folder


def chain(preset: str, sets: Sequence[str]) -> None:
    check_chain(preset, sets)
    steps = chain_steps(preset)
    out = None
    for i, (stage, extra) in enumerate(steps, 1):
        log.info("chain %s: step %d/%d: %s", preset, i, len(steps), stage)
        with scoped_errors(stage):
            out = run_step(stage, preset, [*extra, *split_sets(sets, stage)])
    print(f"semix: dataset ready in {out}")


# ---------------------------------------------------------------- --fields, --print-config


def stage_section(stage: str, preset: str, note: str = "") -> list[str]:
    """--fields of one stage as a chain takes them (`<stage>.key`), shared fields left out."""
    cfg_mod = config_module(stage)
    title = f"{stage}: --set {stage}.key=value" + (f" ({note})" if note else "")
    rows = describe_fields(cfg_mod.Config, cfg_mod.PRESETS, preset, scoped(stage), SHARED_FIELDS)
    return [title, *rows]


def shared_section() -> list[str]:
    skip = [f.name for f in dataclasses.fields(StageConfig) if f.name not in SHARED_FIELDS]
    return ["shared by every stage: --set key=value", *describe_fields(StageConfig, skip=skip)]


def chain_fields(preset: str, more: Sequence[str] = ()) -> list[str]:
    """--fields of a chain (and of the stages in `more`, that a demo or study runs after it)."""
    steps = chain_steps(preset)
    lines = shared_section()
    for stage in dict.fromkeys([*(s for s, _ in steps), *more]):  # each once, in order
        fixed = [" ".join(extra) for s, extra in steps if s == stage and extra]
        note = f"the chain sets {'; then '.join(fixed)}" if fixed else ""
        lines += ["", *stage_section(stage, preset, note)]
    return lines


def fields_text(preset: str) -> str:
    """`semix chain --fields`: every field of every step, as the chain's --set spells it."""
    return "\n".join([f"semix chain --preset {preset}: its steps' fields", *chain_fields(preset)])


def chain_configs(preset: str, sets: Sequence[str]) -> list[dict[str, Any]]:
    """Every step's resolved config, in order (each checked as `chain` checks them)."""
    check_chain(preset, sets)
    steps = chain_steps(preset)
    return [
        {
            "stage": stage,
            "config": every_field(
                resolve_stage_config(stage, preset, [*extra, *split_sets(sets, stage)])
            ),
        }
        for stage, extra in steps
    ]


def resolved(preset: str, sets: Sequence[str]) -> dict[str, Any]:
    """`semix chain --print-config`: what each step would run with; nothing runs."""
    return {"chain": chain_configs(preset, sets)}
