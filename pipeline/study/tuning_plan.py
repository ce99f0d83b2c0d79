"""The tuning grids as tasks of the study's plan (pipeline/study/tuning.py holds the grids and
the rule that chooses on them): every group's grid runs and its extensions, each at every tuning
seed, and study.json's "tuning", every group's choice as the study's runs were given it (its
parameters by path here, under study.json's names there: `recorded_tuning`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline.chain import split_sets
from pipeline.study.config import METHODS, StudyConfig
from pipeline.study.intervals import PRIMARY_ENDPOINTS
from pipeline.study.mixed_sets import link_complete, variant_root
from pipeline.study.tuning import (
    BOUNDS,
    GRIDS,
    MAX_EXTENSIONS,
    NEEDS,
    SHARED,
    WEIGHT_DECAY,
    TuneTask,
    base_run,
    choose,
    chosen_sets,
    grid_points,
    next_point,
    own_choice,
    params,
    plan_groups,
    recorded_names,
    set_values,
    shares_weight_decay,
    tune_run,
    tune_seeds,
    tuned_rows,
    tuning_alias,
    tuning_group,
)
from shards.manifest import is_complete

CSM_WEIGHT = "loss.csm.weight"  # csm3's grid runs take csm's chosen weight


def _prepare_weight_decay(
    root: Path, tasks: list[TuneTask], fixed: Callable[[], list[str]] | None
) -> list[str]:
    """A shared weight-decay point's other --set values: its group's own choice (its decay is
    in its own sets)."""
    return [*(fixed() if fixed else []), *set_values(own_choice(root, tasks))]


def _prepare_extension(
    root: Path, tasks: list[TuneTask], key: str, param: str, fixed: Callable[[], list[str]] | None
) -> list[str] | None:
    """An extension step's --set values, or None when the choice before it needs no step of
    `param` (a tried neighbour on each side, or a bound)."""
    point = next_point(tasks[0].group, tuned_rows(root, tasks, key), param)
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
    """Its run is complete, or every task before it is done and its step has nothing to run."""
    if is_complete(root / task.stage_dir / task.name):
        return True
    if not all(t.done for t in tasks[: tasks.index(task)]):
        return False
    try:
        return next_point(task.group, tuned_rows(root, tasks, task.key), task.param) is None
    except (OSError, ValueError, KeyError, StopIteration):  # a run's metrics unreadable
        return False


def _group_tasks(
    group: str,
    root: Path,
    train_sets: Sequence[str],
    ft_sets: Sequence[str],
    tuned: dict[str, list[TuneTask]],
    seeds: Sequence[int],
) -> list[TuneTask]:
    """A group's tasks, each at every tuning seed: its own grid (at the reference weight decay),
    the shared weight-decay grid at its own choice (a train group whose own grid is not weight
    decay), then MAX_EXTENSIONS extension steps per parameter, step k of every parameter after
    step k - 1 of all, each after every task before it (its prepare decides from their
    scores)."""
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
            fixed = functools.partial(chosen_sets, root, tuned, (NEEDS[group],), (CSM_WEIGHT,))

    def make(at: dict[str, float] | tuple[str, int], seed: int, prepare, **kw) -> TuneTask:
        """The run of grid point `at` (or extension step `at` = (parameter, k)) at `seed`."""
        name = tune_run(group, at, seed)
        values = [] if isinstance(at, tuple) else set_values(at)
        if kw.get("role", "grid") == "grid" and shares_weight_decay(group):
            values += set_values({WEIGHT_DECAY: SHARED.reference})
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
    after |= {t.name for t in grid}  # the rest: the whole grid first, it decides their points
    if shares_weight_decay(group):
        prepare = functools.partial(_prepare_weight_decay, root, tasks, fixed)
        shared = [
            make({WEIGHT_DECAY: v}, seed, prepare, role="wd", point={WEIGHT_DECAY: v})
            for v in SHARED.values
            if v != SHARED.reference
            for seed in seeds
        ]
        tasks += shared
        after |= {t.name for t in shared}
    for k in range(1, MAX_EXTENSIONS + 1):
        for param in params(group):
            key = tune_run(group, (param, k))
            prepare = functools.partial(_prepare_extension, root, tasks, key, param, fixed)
            step = [
                make((param, k), seed, prepare, role="ext", param=param, step=k) for seed in seeds
            ]
            tasks += step
            after |= {t.name for t in step}
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
    (study.json "tuning", its parameters under study.json's names: recorded_tuning): csm3 adds
    the csm w it ran at ("at"), a MaC-Cal group its base runs (one per tuning seed). Every study
    method has a grid (tuning_group)."""
    tuned = tuning_tasks(cfg, root, sets)
    report: dict[str, Any] = {}
    for group, tasks in tuned.items():
        grid = {k: list(v) for k, v in GRIDS[group].items()}
        shared = {WEIGHT_DECAY: list(SHARED.values)} if shares_weight_decay(group) else {}
        result = {
            "params": {**grid, **shared},
            "bounds": {p: list(BOUNDS[group][p]) for p in params(group)},
            **choose(root, tasks),
        }
        if group == "csm3":
            result["at"] = {CSM_WEIGHT: choose(root, tuned["csm"])["chosen"][CSM_WEIGHT]}
        if METHODS[group].stage == "finetune":
            result["base"] = choose(root, tuned[NEEDS[group]])["chosen_runs"]
        report[group] = recorded_tuning(group, result)
    return report


# a group's result's fields keyed by parameter (besides: `at_bound`, a list of parameters, and
# `grid`, rows that hold the parameters among other keys)
BY_PARAMETER = ("params", "bounds", "reference", "chosen", "extended", "interior", "at")


def recorded_tuning(group: str, result: dict[str, Any]) -> dict[str, Any]:
    """A group's result as study.json records it: each parameter under config.json's key
    (tuning.recorded_names: `optim.weight_decay` -> `weight_decay`), as it has always been
    written, so a study.json keeps its bytes and report.md (which reads study.json, also
    report_from_json) its words; the rest as it is."""
    out: dict[str, Any] = {}
    for field, value in result.items():
        if field in BY_PARAMETER:
            value = recorded_names(group, value)
        elif field == "at_bound":
            value = list(recorded_names(group, dict.fromkeys(value)))
        elif field == "grid":
            value = [recorded_names(group, row) for row in value]
        out[field] = value
    return out


def configurations(cfg: StudyConfig, tuning: dict[str, Any]) -> dict[str, Any]:
    """study.json's "configurations": the val configurations each tuned method's choice was made
    among (its group's tried points; csm3's w comes from csm's), and whether the methods of the
    primary endpoints had the same number within one (`balanced`; the report says so when not).
    The csm family's generator cells are counted apart, in study.json's "generator"."""
    methods = {
        m: {"group": g, "configurations": tuning[g]["configurations"]}
        for m in cfg.methods
        if (g := tuning_group(m)) and g in tuning
    }
    primary = [m for m in dict.fromkeys(e for *_, a, b in PRIMARY_ENDPOINTS for e in (a, b))]
    counts = [methods[m]["configurations"] for m in primary if m in methods]
    spread = max(counts) - min(counts) if counts else 0
    return {
        "methods": methods,
        "primary": [m for m in primary if m in methods],
        "spread": spread,
        "balanced": spread <= 1,
    }
