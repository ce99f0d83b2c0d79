"""`make study`'s tuning: every method's own hyper-parameters and, for a train method, its
weight decay, chosen on the validation split by one search and one rule fixed before the run in
the protocol (docs/protocol.toml; docs/study.md).

GRIDS declares one grid per tuning group, {train or finetune leaf: values}, the protocol's: 4
points each (2 x 2 for a two-parameter method, 4 values for a one-parameter one), around the
published defaults. REFERENCE names each grid's reference point: the default the method runs with
untuned. The search, the same for every train method (a coordinate search; a full cross would
cost 16 points a method): its own grid at the reference weight decay, then the shared
weight-decay grid (SHARED) at its own choice, 4 + 3 = 7 configurations; ce, with no parameter
of its own, tunes weight decay alone on the shared grid refined by its midpoints, 7 values.
Every point runs at the same `tune_seeds` seeds (TUNE_SEED, TUNE_SEED + 1, ...; no study seed:
a tuning run is never a study run), so the points are paired by seed. A run's score is its val
NLL at its chosen checkpoint: a train run's best-val-accuracy epoch (the checkpoint it keeps), a
fine-tuning's last epoch (it keeps its last weights). NLL because it rewards accuracy and
calibration at once; no tuning run is evaluated, so the test split is never read for it.

The rule (`choose_point`, the same for every group): a point's score is its mean val NLL over the
tuning seeds; the lowest wins (ties: the first in grid order) only when its advantage over the
reference, the mean of its paired per-seed differences, exceeds that mean's standard error;
otherwise the reference is chosen: a gap inside the seeds' noise moves nothing.

Interior optima: then each parameter extends, one geometric step at a time, until the chosen
point has a tried neighbour on each side along it or sits on a bound of the protocol (BOUNDS),
at most MAX_EXTENSIONS steps per parameter: tasks tune-<group>-ext-<letter><k>, step k of every
parameter after step k - 1 of all, each deciding its point from the scores before it
(next_point; None: nothing to run, the study skips it). A method's runs take the final choice
through their task's prepare, so they wait for every step.

Groups: csm's (w x s) serves the whole 2-way csm family (csm, csm-ratio, csm-ce, csm-redraw);
csm3 tunes s at csm's chosen w on its own k = 3 set; ce its weight decay; ls, focal, mixup, mmce
and fedlas-ls their loss parameters; ce+maccal and csm+maccal MaC-Cal's r and q0, one grid each on
its base method's chosen grid runs (seed by seed), because the best head for a ce backbone need
not be the best for a csm one. MaC-Cal writes finetune/<run>-maccal, so each of its points
fine-tunes its own name of the base: train/tune-ce-r128-q0p7 is a hard-linked copy of ce's chosen
run (pipeline.study.mixed_sets.link_complete) and its fine-tuning is
finetune/tune-ce-r128-q0p7-maccal.

Run names: tune-<group>-<letter><value>... at TUNE_SEED (the shared decays tune-<group>-wd<value>),
tune-<group>-...-t<seed> at the others (MaC-Cal: tune-<base>-...[-t<seed>]-maccal).

The grids, names and the rule live here; their runs as tasks of the study's plan, and study.json's
"tuning" and "configurations", in pipeline/study/tuning_plan.py.

Every parameter is named by its leaf's path in the stage config its runs are made by
(`loss.ls.alpha`, `optim.weight_decay`, `maccal.q0`), as `--set` takes it. Two files name them
otherwise, both records: docs/protocol.toml, the committed protocol, and study.json, both by
config.json's keys (`ls_alpha`). `param_path` reads the protocol's names as paths and
`recorded_names` writes paths as study.json's names, both through core.codec's key mapping of
the group's stage config: those two functions are the only places a name changes, so
study.json keeps its bytes and a study root planned by older code plans the same tasks (the
run letters, LETTERS, are the same).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from core import codec
from core.io import read_json
from pipeline.study.config import METHODS, StudyConfig, StudyError, Task
from pipeline.study.protocol import PROTOCOL
from stages.configs import finetune as finetune_config
from stages.configs import train as train_config

TUNE_SEED = PROTOCOL.tune_first  # the first tuning seed: no study seed, a tuning run is never one
WEIGHT_DECAY = "optim.weight_decay"  # train's: the knob every train method shares
SHARED = PROTOCOL.weight_decay  # its grid, reference and bounds
MAX_EXTENSIONS = PROTOCOL.max_extensions  # extension steps per parameter: the plan stays finite


def refined(values: Sequence[float]) -> tuple[float, ...]:
    """A grid and its geometric midpoints (3 significant digits): 2n - 1 values, the grid of a
    method with no parameter of its own (ce), so it gets as many configurations as a two-round
    search of an n-point grid of its own and the n-point shared grid (n + n - 1)."""
    ordered = sorted(values)
    mids = [float(f"{math.sqrt(a * b):.3g}") for a, b in pairwise(ordered)]
    return tuple(sorted([*ordered, *mids]))


def stage_config(group: str) -> type:
    """The config class a group's runs are made by: finetune's for a MaC-Cal group, else
    train's."""
    return finetune_config.Config if METHODS[group].stage == "finetune" else train_config.Config


def param_path(group: str, name: str) -> str:
    """The path of a grid parameter docs/protocol.toml names by config.json's key
    (`ls_alpha`: `loss.ls.alpha`; core.codec.path)."""
    return codec.path(stage_config(group), name)


def recorded_names(group: str, values: dict[str, Any]) -> dict[str, Any]:
    """`values` with each key that is a leaf's path of the group's stage config under the name
    study.json records it by, config.json's key (core.codec.key: `loss.ls.alpha` -> `ls_alpha`,
    `optim.weight_decay` -> `weight_decay`); other keys (`run`, `val_nll`) as they
    are, the order kept. What study.json's "tuning" (tuning_plan.tuning_report) and its
    "generator"'s `at` (cells.choose_cell) are written through: study.json keeps its bytes and
    report.md, which reads it, its words."""
    cls = stage_config(group)
    return {codec.key(cls, k): v for k, v in values.items()}


# group -> {train or finetune leaf: values}, the protocol's (docs/protocol.toml, its names read
# as paths); a group is named after the method it tunes. ce, with no parameter of its own, tunes
# weight decay alone on the shared grid refined by its midpoints; every other train group tunes
# weight decay after its own grid (shares_weight_decay)
GRIDS: dict[str, dict[str, tuple[float, ...]]] = {
    group: {param_path(group, k): p.values for k, p in params.items()}
    or {WEIGHT_DECAY: refined(SHARED.values)}
    for group, params in PROTOCOL.grids.items()
}
# each grid's reference point: the value its method runs with untuned (the protocol's); the rule
# falls back to it when a winner's advantage is within the seeds' noise
REFERENCE: dict[str, dict[str, float]] = {
    group: {param_path(group, k): p.reference for k, p in params.items()}
    or {WEIGHT_DECAY: SHARED.reference}
    for group, params in PROTOCOL.grids.items()
}
# where an extension stops: every parameter's bounds in the protocol
BOUNDS: dict[str, dict[str, tuple[float, float]]] = {
    group: {param_path(group, k): p.bounds for k, p in params.items()}
    | {WEIGHT_DECAY: SHARED.bounds}
    for group, params in PROTOCOL.grids.items()
}
# a parameter's letter in run names: tune-csm-w0p5-s2p3, tune-ls-a0p05, tune-ce-r128-q0p7-maccal
# (the names of every study's runs: a letter never changes)
LETTERS = {
    "optim.weight_decay": "wd",
    "loss.csm.weight": "w", "loss.csm.sharpening": "s", "loss.ls.alpha": "a",
    "loss.focal.gamma": "g", "loss.mixup.alpha": "a", "loss.mmce.lam": "l",
    "loss.fedlas_ls.alpha": "a", "loss.fedlas_ls.beta": "b",
    "maccal.r": "r", "maccal.q0": "q",
}  # fmt: skip
INTEGERS = ("maccal.r",)  # a whole number of units
# a group whose runs need another group's choice: csm3 its w, a MaC-Cal group its chosen runs
NEEDS = {"csm3": "csm", "ce+maccal": "ce", "csm+maccal": "csm"}


def tuning_group(method: str) -> str:
    """The grid that tunes a method: csm's for the 2-way csm family, csm3's for the k = 3 set,
    the method's own (GRIDS) for the others; "" for one with nothing to tune."""
    m = METHODS[method]
    if m.stage == "train" and "loss=csm" in m.sets:
        return f"csm{m.mix_classes}" if m.mix_classes > 2 else "csm"
    return method if method in GRIDS else ""


def plan_groups(method: str) -> tuple[str, ...]:
    """The groups whose runs a method's runs wait for, in the order they run."""
    group = tuning_group(method)
    return () if not group else (NEEDS[group], group) if group in NEEDS else (group,)


def chosen_groups(method: str) -> tuple[str, ...]:
    """The groups whose choice a method's runs take, a later one's values winning: csm3 takes
    csm's w and its own s; a MaC-Cal method only its r and q0 (its base run is already tuned)."""
    group = tuning_group(method)
    return ("csm", group) if group == "csm3" else (group,) if group else ()


def shares_weight_decay(group: str) -> bool:
    """A train group whose own grid is not weight decay: it tunes the shared weight-decay grid
    after its own (MaC-Cal's fine-tunings have none; ce's own grid is weight decay)."""
    return METHODS[group].stage == "train" and WEIGHT_DECAY not in GRIDS[group]


def params(group: str) -> tuple[str, ...]:
    """Every parameter a group chooses: its own, then weight decay where it shares it."""
    return (*GRIDS[group], *((WEIGHT_DECAY,) if shares_weight_decay(group) else ()))


def reference(group: str) -> dict[str, float]:
    """The group's reference point over all its parameters (weight decay's where it shares it)."""
    shared = {WEIGHT_DECAY: SHARED.reference} if shares_weight_decay(group) else {}
    return {**REFERENCE[group], **shared}


def planned_configurations(group: str) -> int:
    """The val configurations a group's search tries before any extension: its own grid, then
    the shared weight-decay grid but its reference (already tried) at its own choice."""
    extra = len(SHARED.values) - 1 if shares_weight_decay(group) else 0
    return len(grid_points(group)) + extra


def tune_run(group: str, point: dict[str, float] | tuple[str, int], seed: int = TUNE_SEED) -> str:
    """The tuning run's folder name (no dots in run names): tune-<group>-<letter><value>...
    for a grid point (tune-<group>-wd<value> for a point of the shared weight-decay grid),
    tune-<group>-ext-<letter><k> for step k of a parameter's extension (`point`: (parameter,
    k)), with -t<seed> after it at every seed but TUNE_SEED; MaC-Cal's is its fine-tuning,
    tune-<base>-...-maccal (tuning_alias: the train run it reads)."""
    if isinstance(point, tuple):
        tail = f"ext-{LETTERS[point[0]]}{point[1]}"
    else:
        tail = "-".join(f"{LETTERS[k]}{v:g}" for k, v in point.items()).replace(".", "p")
    if seed != TUNE_SEED:
        tail += f"-t{seed}"
    m = METHODS[group]
    return f"tune-{m.base}-{tail}-maccal" if m.stage == "finetune" else f"tune-{group}-{tail}"


def tuning_alias(name: str) -> str:
    """The train run a MaC-Cal tuning run fine-tunes: its own copy of the base run."""
    return name.removesuffix("-maccal")


def tune_seeds(cfg: StudyConfig) -> tuple[int, ...]:
    return tuple(TUNE_SEED + i for i in range(cfg.tune_seeds))


def grid_points(group: str) -> list[dict[str, float]]:
    """Every point of a group's grid, the first parameter slowest."""
    points: list[dict[str, float]] = [{}]
    for key, values in GRIDS[group].items():
        points = [{**p, key: v} for p in points for v in values]
    return points


@dataclass
class TuneTask(Task):
    group: str = ""
    # grid (its own grid) | wd (a shared weight-decay value at its own choice) | ext (one
    # extension step of a parameter)
    role: str = "grid"
    stage_dir: str = "train"  # where its run lands: train | finetune
    point: dict[str, float] = field(default_factory=dict)  # grid: its values; wd: its decay
    param: str = ""  # ext: the parameter it steps
    step: int = 0  # ext: its step, 1 ... MAX_EXTENSIONS
    seed: int = TUNE_SEED
    key: str = ""  # its point's name: the run at TUNE_SEED (the seeds of a point share it)


# ---------------------------------------------------------------- scores and the rule


def val_score(run: Path) -> dict[str, float]:
    """Validation accuracy, ECE and NLL at a train run's chosen checkpoint (best val accuracy)."""
    train = read_json(run / "metrics.json")["train"]
    best = next(h for h in train["history"] if h["val_acc"] == train["best_val_acc"])
    return {k: round(float(best[k]), 4) for k in ("val_acc", "val_ece", "val_nll")}


def last_score(run: Path) -> dict[str, float]:
    """The same at a fine-tuning's last epoch: the weights it keeps."""
    last = read_json(run / "metrics.json")["finetune"]["history"][-1]
    return {k: round(float(last[k]), 4) for k in ("val_acc", "val_ece", "val_nll")}


def score(root: Path, task: TuneTask) -> dict[str, float]:
    run = root / task.stage_dir / task.name
    return last_score(run) if task.stage_dir == "finetune" else val_score(run)


def choose_point(rows: Sequence[dict[str, Any]], reference: dict[str, float]) -> dict[str, Any]:
    """The tuning rule, the same for every group: the row (a point with `val_nll_seeds`, its
    val NLL at each tuning seed, in the same seed order for every row) of the lowest mean val
    NLL wins (ties: the first) when its advantage over the `reference` row, the mean of their
    paired per-seed differences, exceeds that mean's standard error (sample std / sqrt(seeds));
    else the reference is chosen. A point whose val NLL is not finite at some seed (its
    training diverged) never wins; a diverged reference gives way to the lowest finite row.
    Returns {"chosen": row, "winner": the lowest row's run, "advantage", "standard_error",
    "kept_reference": bool}."""
    ref = next(r for r in rows if all(r[k] == v for k, v in reference.items()))
    finite = [r for r in rows if np.isfinite(r["val_nll_seeds"]).all()]
    if not finite:
        raise StudyError(f"every point of the grid of {ref['run']} diverged (val NLL not finite)")
    best = min(finite, key=lambda r: np.mean(r["val_nll_seeds"]))
    if not np.isfinite(ref["val_nll_seeds"]).all():
        return {"chosen": best, "winner": best["run"], "advantage": None,
                "standard_error": None, "kept_reference": False}  # fmt: skip
    if best is ref:
        return {"chosen": ref, "winner": ref["run"], "advantage": 0.0, "standard_error": 0.0,
                "kept_reference": True}  # fmt: skip
    gaps = np.asarray(ref["val_nll_seeds"]) - np.asarray(best["val_nll_seeds"])
    se = float(gaps.std(ddof=1) / math.sqrt(len(gaps))) if len(gaps) > 1 else math.inf
    advantage = float(gaps.mean())
    chosen = best if advantage > se else ref
    return {
        "chosen": chosen,
        "winner": best["run"],
        "advantage": round(advantage, 6),
        "standard_error": round(se, 6) if math.isfinite(se) else None,
        "kept_reference": chosen is ref,
    }


def score_row(
    run: str, values: dict[str, Any], scores: Sequence[dict[str, float]], runs: Sequence[str]
) -> dict[str, Any]:
    """A point's row for the rule (choose_point) and study.json: its name (`run`, its run at
    TUNE_SEED), its `values`, the mean of each score over its seeds (`scores`, one per seed, in
    seed order), its val NLL per seed and its `runs` (the same order)."""
    return {
        "run": run,
        **values,
        **{k: round(float(np.mean([s[k] for s in scores])), 4) for k in scores[0]},
        "val_nll_seeds": [s["val_nll"] for s in scores],
        "runs": list(runs),
    }


def _row(root: Path, tasks: Sequence[TuneTask], values: dict[str, float]) -> dict[str, Any]:
    """A point's row (`tasks`: its runs, one per tuning seed): its values, the mean of each
    score over its seeds, its val NLL per seed, its runs and its role."""
    runs = sorted(tasks, key=lambda t: t.seed)
    row = score_row(runs[0].key, values, [score(root, t) for t in runs], [t.name for t in runs])
    return {**row, "role": runs[0].role, "extension": runs[0].role == "ext"}


def _by_key(tasks: Sequence[TuneTask]) -> dict[str, list[TuneTask]]:
    """The tasks of each point (its key), the points in plan order."""
    by_key: dict[str, list[TuneTask]] = defaultdict(list)
    for t in tasks:
        by_key[t.key].append(t)
    return by_key


def own_choice(root: Path, tasks: Sequence[TuneTask]) -> dict[str, float]:
    """The rule's choice over the group's own grid (at the reference weight decay): the own
    values the shared weight-decay grid then runs at."""
    group = tasks[0].group
    grid = [t for t in tasks if t.role == "grid"]
    rows = [_row(root, ts, _grid_values(ts[0])) for ts in _by_key(grid).values()]
    chosen = choose_point(rows, reference(group))["chosen"]
    return {k: chosen[k] for k in GRIDS[group]}


def _grid_values(task: TuneTask) -> dict[str, float]:
    shared = {WEIGHT_DECAY: SHARED.reference} if shares_weight_decay(task.group) else {}
    return {**task.point, **shared}


def tuned_rows(
    root: Path, tasks: Sequence[TuneTask], until: str | None = None
) -> list[dict[str, Any]]:
    """Every point the group tried before the task of key `until` (all: None), in plan order,
    as rows (an extension with nothing to do has none). An extension's point is not in its
    name: it is replayed, step by step, from the scores before it, as its prepare computed it."""
    group = tasks[0].group
    rows: list[dict[str, Any]] = []
    own: dict[str, float] | None = None
    for key, ts in _by_key(tasks).items():
        if key == until:
            break
        t = ts[0]
        if t.role == "grid":
            rows.append(_row(root, ts, _grid_values(t)))
        elif t.role == "wd":
            own = own if own is not None else own_choice(root, tasks)
            rows.append(_row(root, ts, {**own, **t.point}))
        elif (point := next_point(group, rows, t.param)) is not None:
            rows.append(_row(root, ts, point))
    return rows


def _round(value: float, param: str) -> float:
    return round(value) if param in INTEGERS else float(f"{value:.3g}")


def missing_sides(
    group: str, rows: Sequence[dict[str, Any]], chosen: dict[str, Any], param: str
) -> list[tuple[int, float | None]]:
    """The sides (-1 below, +1 above) where the chosen point has no tried neighbour along
    `param` (the tried points equal to it in every other parameter), each with the value to try
    there: the nearest value of `param` tried anywhere in the group on that side, else one
    geometric step out (chosen² / its nearest value on the other side), clamped to the
    protocol's bound; None where the chosen value already sits on that bound."""
    others = [q for q in params(group) if q != param]
    line = [r for r in rows if all(r[q] == chosen[q] for q in others)]
    ladder = sorted({r[param] for r in rows} | set(GRIDS[group].get(param, SHARED.values)))
    c, (lo, hi) = chosen[param], BOUNDS[group][param]
    sides: list[tuple[int, float | None]] = []
    for side in (-1, 1):
        if any((r[param] - c) * side > 0 for r in line):
            continue  # a tried neighbour on this side
        beyond = [v for v in ladder if (v - c) * side > 0]
        behind = [v for v in ladder if (v - c) * side < 0]
        if beyond:  # a value tried elsewhere, not yet on this line
            new = min(beyond, key=lambda v: abs(v - c))
        elif behind:
            new = _round(min(max(c * c / min(behind, key=lambda v: abs(v - c)), lo), hi), param)
        else:
            continue
        sides.append((side, None if new == c else new))
    return sides


def next_point(group: str, rows: Sequence[dict[str, Any]], param: str) -> dict[str, float] | None:
    """The point an extension step of `param` runs, from the points tried before it: the
    current choice (the rule over them) with `param` at the value missing_sides names for its
    first side without a neighbour (below first); None when the choice has a tried neighbour on
    each side along `param`, or sits on the bound where one is missing."""
    chosen = choose_point(rows, reference(group))["chosen"]
    for _, value in missing_sides(group, rows, chosen, param):
        if value is not None:
            return {**{k: chosen[k] for k in params(group)}, param: value}
    return None


def choose(root: Path, tasks: Sequence[TuneTask]) -> dict[str, Any]:
    """A group's choice by the rule over every point it tried (its own grid, the shared
    weight-decay grid at its own choice, the extensions): every point's scores (means over the
    tuning seeds), the extensions' values per parameter, the rule's numbers, how many val
    configurations it tried, and where the choice is interior (a tried neighbour on each side)
    or sits on a protocol bound (`at_bound`)."""
    group = tasks[0].group
    rows = tuned_rows(root, tasks)
    rule = choose_point(rows, reference(group))
    chosen = rule.pop("chosen")
    extended: dict[str, list[float]] = {}
    for t in tasks:
        if t.role == "ext" and t.seed == TUNE_SEED:
            row = next((r for r in rows if r["run"] == t.key), None)
            if row is not None:
                extended.setdefault(t.param, []).append(row[t.param])
    sides = {p: missing_sides(group, rows, chosen, p) for p in params(group)}
    return {
        "criterion": "mean val_nll over the tuning seeds; within one standard error: reference",
        "search": PROTOCOL.search,
        "seeds": sorted({t.seed for t in tasks}),
        "reference": reference(group),
        "rule": rule,
        "chosen": {k: chosen[k] for k in params(group)},
        "chosen_run": chosen["run"],
        "chosen_runs": chosen["runs"],
        "configurations": len(rows),
        "extended": extended,
        "interior": {p: not missing for p, missing in sides.items()},
        "at_bound": [p for p, missing in sides.items() if any(v is None for _, v in missing)],
        "grid": rows,
    }


def chosen_sets(
    root: Path,
    tuned: dict[str, list[TuneTask]],
    groups: Sequence[str],
    keys: Sequence[str] | None = None,
) -> list[str]:
    """--set values chosen on val: the groups' choices, a later group's values winning (csm3:
    ("csm", "csm3") takes csm's w and csm3's s); `keys` keeps only those (csm3's grid runs
    take csm's w, not its s)."""
    values: dict[str, float] = {}
    for group in groups:
        chosen = choose(root, tuned[group])["chosen"]
        values |= {k: v for k, v in chosen.items() if keys is None or k in keys}
    return set_values(values)


def set_values(values: dict[str, float]) -> list[str]:
    """`--set` values of grid parameters, each under its path (`loss.csm.weight=1`)."""
    return [f"{k}={v:g}" for k, v in values.items()]


def base_run(root: Path, tuned: dict[str, list[TuneTask]], group: str, seed: int) -> str:
    """The train run a MaC-Cal group's run at tuning seed `seed` fine-tunes: its base method's
    chosen point's run at that seed (paired: every point's seed k starts from the same run)."""
    runs = choose(root, tuned[NEEDS[group]])["chosen_runs"]
    return runs[seed - TUNE_SEED]
