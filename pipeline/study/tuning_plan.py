"""The tuning grids as tasks of the study's plan (pipeline/study/tuning.py holds the grids and
the rule that chooses on them): every group's grid runs and its extensions, each at every tuning
seed, and study.json's "tuning", every group's choice as the study's runs were given it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline.chain import split_sets
from pipeline.study.config import METHODS, StudyConfig
from pipeline.study.mixed_sets import link_complete, variant_root
from pipeline.study.tuning import (
    GRIDS,
    NEEDS,
    TuneTask,
    base_run,
    choose,
    chosen_sets,
    extension_point,
    grid_points,
    plan_groups,
    set_values,
    tune_run,
    tune_seeds,
    tuning_alias,
)
from shards.manifest import is_complete


def _prepare_extension(
    root: Path, tasks: list[TuneTask], param: str, fixed: Callable[[], list[str]] | None
) -> list[str] | None:
    """An extension task's --set values, or None when its grid's choice is interior."""
    point = extension_point(root, tasks, param)
    if point is None:
        return None
    return [*(fixed() if fixed else []), *set_values(point)]


def _prepare_finetune(
    root: Path,
    tuned: dict[str, list[TuneTask]],
    group: str,
    name: str,
    seed: int,
    values: Callable[[], list[str] | None] | None,
) -> list[str] | None:
    """Before a MaC-Cal tuning run: its own name for the base run (hard links), then its
    values (None: an extension with nothing to do, and no copy)."""
    sets = values() if values else []
    if sets is not None:
        link_complete(root / "train" / base_run(root, tuned, group, seed), root / "train" / name)
    return sets


def _extension_done(root: Path, tasks: list[TuneTask], task: TuneTask) -> bool:
    """Its run is complete, or its grid is and chose an interior value (nothing to run)."""
    if is_complete(root / task.stage_dir / task.name):
        return True
    if not all(t.done for t in tasks if t.role == "grid"):
        return False
    try:
        return extension_point(root, tasks, task.param) is None
    except (OSError, ValueError, KeyError, StopIteration):  # a grid run's metrics unreadable
        return False


def _group_tasks(
    group: str,
    root: Path,
    train_sets: Sequence[str],
    ft_sets: Sequence[str],
    tuned: dict[str, list[TuneTask]],
    seeds: Sequence[int],
) -> list[TuneTask]:
    """A group's tasks: its grid and one extension per parameter, each at every tuning seed."""
    m = METHODS[group]
    stage = "finetune" if m.stage == "finetune" else "train"
    tasks: list[TuneTask] = []
    after: set[str] = {"chain"} if m.needs_mixed and not m.variant else set()
    extra: list[str] = []  # sets of every run of the group
    fixed = None  # --set values from another group's choice, computed when a run starts
    if m.variant:
        after = {f"chain-{m.variant}"}
        extra = [f"mixed={variant_root(root, m.variant) / 'mixed'}"]
    if group in NEEDS:
        after |= {t.name for t in tuned[NEEDS[group]]}
        if stage == "train":  # csm3: csm's chosen w
            fixed = functools.partial(chosen_sets, root, tuned, (NEEDS[group],), ("csm_weight",))

    def make(at: dict[str, float] | str, seed: int, prepare, **kw) -> TuneTask:
        """The run of grid point `at` (or the extension of parameter `at`) at `seed`."""
        name = tune_run(group, at, seed)
        values = [] if isinstance(at, str) else set_values(at)
        if stage == "finetune":
            run = tuning_alias(name)
            sets = [*ft_sets, *m.sets, *values, f"run={run}", f"seed={seed}"]
            prepare = functools.partial(_prepare_finetune, root, tuned, group, run, seed, prepare)
        else:
            sets = [*train_sets, *m.sets, *extra, *values, f"run={name}", f"seed={seed}"]
        done = is_complete(root / stage / name)
        return TuneTask(
            name, [(stage, sets)], set(after), done, prepare, group=group, stage_dir=stage,
            seed=seed, key=tune_run(group, at), **kw,
        )  # fmt: skip

    grid = [make(p, seed, fixed, point=p) for p in grid_points(group) for seed in seeds]
    tasks += grid
    after |= {t.name for t in grid}  # an extension: the whole grid first, it decides the step
    for param in GRIDS[group]:
        prepare = functools.partial(_prepare_extension, root, tasks, param, fixed)
        tasks += [make(param, seed, prepare, role="ext", param=param) for seed in seeds]
    for t in tasks:
        if t.role == "ext":
            t.done = _extension_done(root, tasks, t)
    return tasks


def tuning_tasks(cfg: StudyConfig, root: Path, sets: Sequence[str]) -> dict[str, list[TuneTask]]:
    """The tasks of every group the study's methods need ({group: tasks}, in the order they
    run: ce before ce+maccal, csm before csm3 and csm+maccal). Grid runs read the val split only
    (never evaluated)."""
    groups = dict.fromkeys(g for method in cfg.methods for g in plan_groups(method))
    train_sets, ft_sets = split_sets(sets, "train"), split_sets(sets, "finetune")
    tuned: dict[str, list[TuneTask]] = {}
    for group in groups:
        tuned[group] = _group_tasks(group, root, train_sets, ft_sets, tuned, tune_seeds(cfg))
    return tuned


def tuning_report(cfg: StudyConfig, root: Path, sets: Sequence[str]) -> dict[str, Any]:
    """Every group's grid, extensions and choice, as the study's runs were given them
    (study.json "tuning"): csm3 adds the csm w it ran at ("at"), a MaC-Cal group its base runs
    (one per tuning seed). Every study method has a grid (tuning_group)."""
    tuned = tuning_tasks(cfg, root, sets)
    report: dict[str, Any] = {}
    for group, tasks in tuned.items():
        result = {"params": {k: list(v) for k, v in GRIDS[group].items()}, **choose(root, tasks)}
        if group == "csm3":
            result["at"] = {"csm_weight": choose(root, tuned["csm"])["chosen"]["csm_weight"]}
        if METHODS[group].stage == "finetune":
            result["base"] = choose(root, tuned[NEEDS[group]])["chosen_runs"]
        report[group] = result
    return report
