"""`make study`'s tuning: every method's own hyper-parameters chosen on the validation split,
from a grid of the same size, by one rule fixed before the run (docs/study.md).

GRIDS declares one grid per tuning group, {train or finetune field: values}: 4 points each (2 x 2
for a two-parameter method, 4 values for a one-parameter one), around the published defaults.
REFERENCE names each grid's reference point: the default the method runs with untuned. Every
point runs at the same `tune_seeds` seeds (TUNE_SEED, TUNE_SEED + 1, ...; no study seed: a tuning
run is never a study run), so the points are paired by seed. A run's score is its val NLL at its
chosen checkpoint: a train run's best-val-accuracy epoch (the checkpoint it keeps), a
fine-tuning's last epoch (it keeps its last weights). NLL because it rewards accuracy and
calibration at once; no tuning run is evaluated, so the test split is never read for it.

The rule (`choose_point`, the same for every group): a point's score is its mean val NLL over the
tuning seeds; the lowest wins (ties: the first in grid order) only when its advantage over the
reference, the mean of its paired per-seed differences, exceeds that mean's standard error;
otherwise the reference is chosen: a gap inside the seeds' noise moves nothing.

Groups: csm's (w x s) serves the whole 2-way csm family (csm, csm-ratio, csm-ce, csm-redraw);
csm3 tunes s at csm's chosen w on its own k = 3 set; ce its weight decay; ls, focal, mixup, mmce
and fedlas-ls their loss parameters; ce+maccal and csm+maccal MaC-Cal's r and q0, one grid each on
its base method's chosen grid runs (seed by seed), because the best head for a ce backbone need
not be the best for a csm one. MaC-Cal writes finetune/<run>-maccal, so each of its points
fine-tunes its own name of the base: train/tune-ce-r128-q0p7 is a hard-linked copy of ce's chosen
run (pipeline.study.mixed_sets.link_complete) and its fine-tuning is
finetune/tune-ce-r128-q0p7-maccal.

Run names: tune-<group>-<letter><value>... at TUNE_SEED, tune-<group>-...-t<seed> at the others
(MaC-Cal: tune-<base>-...[-t<seed>]-maccal).

Edge rule, once: a chosen value that is the smallest or largest of its grid values gets one more
point, task tune-<group>-ext-<p> (and its other seeds), one geometric step outward (v²/neighbour:
v·(v/neighbour) above the max, v/(neighbour/v) below the min), the group's other parameters at
their chosen values; then the choice is made again, by the same rule, over all the group's
points. An interior choice leaves the tasks nothing to do: their prepare returns None and the
study skips them. A method's runs take the final choice through their task's prepare, so they
wait for the extension tasks too.

The grids, names and the rule live here; their runs as tasks of the study's plan, and study.json's
"tuning", in pipeline/study/tuning_plan.py.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core.io import read_json
from pipeline.study.config import METHODS, StudyConfig, StudyError, Task
from stages.configs import finetune as finetune_config
from stages.configs import train as train_config

TUNE_SEED = 100  # the first tuning seed: no study seed, a tuning run is never a study run
POINTS = 4  # every group's grid size: the same tuning budget for every method

# MaC-Cal's r = 256 and q0 = 0.9 are the finetune config's (guessed) defaults: each with one step
# below
MACCAL_GRID: dict[str, tuple[float, ...]] = {"maccal_r": (128, 256), "maccal_q0": (0.7, 0.9)}
# group -> {train or finetune field: values}; a group is named after the method it tunes
GRIDS: dict[str, dict[str, tuple[float, ...]]] = {
    # weight decay 5e-4 (the train config's), x2 steps: how hard ce is held back from
    # overconfidence, its one lever on calibration
    "ce": {"weight_decay": (2.5e-4, 5e-4, 1e-3, 2e-3)},
    # w = 1 (the reference code), w / 2; s = 4 (CIFAR-10, Tiny) and 2.3 (CIFAR-100)
    "csm": {"csm_weight": (0.5, 1.0), "csm_sharpening": (2.3, 4.0)},
    # s at csm's chosen w: a k = 3 vertex target as sharp as k = 2's at s = 4 needs s ≈ 5.4 (x1.35,
    # docs/study.md); a x1.35 ladder around it also holds k = 3's match of s = 2.3 (≈ 3.1)
    "csm3": {"csm_sharpening": (3.0, 4.0, 5.4, 7.3)},
    # α = 0.05 (CIFAR-10, Tiny) and 0.1 (CIFAR-100), x2 steps either side
    "ls": {"ls_alpha": (0.02, 0.05, 0.1, 0.2)},
    # γ = 3 (the focal-calibration paper's), 5 (FLSD-53's high γ), 1 and 2 (the rest of Mukhoti et al.'s grid)
    "focal": {"focal_gamma": (1.0, 2.0, 3.0, 5.0)},
    # α = 1 (Zhang et al., CIFAR; the preset's GUESS), 0.2 (ImageNet), 0.1-0.4 (Thulasidasan et
    # al.'s calibration study)
    "mixup": {"mixup_alpha": (0.1, 0.2, 0.4, 1.0)},
    # λ = 2 (the focal-calibration code), x2 steps
    "mmce": {"mmce_lam": (1.0, 2.0, 4.0, 8.0)},
    # α = 0.05 (CIFAR-10, Tiny) and 0.1 (CIFAR-100), β = 4 and 4 / 2
    "fedlas-ls": {"fedlas_ls_alpha": (0.05, 0.1), "fedlas_ls_beta": (2.0, 4.0)},
    "ce+maccal": MACCAL_GRID,
    "csm+maccal": MACCAL_GRID,
}
# each grid's reference point: the value its method runs with untuned (the train and finetune
# configs' defaults; csm's s = 4, the sharpening annotate uses, and csm3's s = 5.4, its k = 3
# match); the rule falls back to it when a winner's advantage is within the seeds' noise
REFERENCE: dict[str, dict[str, float]] = {
    "ce": {"weight_decay": 5e-4},
    "csm": {"csm_weight": 1.0, "csm_sharpening": 4.0},
    "csm3": {"csm_sharpening": 5.4},
    "ls": {"ls_alpha": 0.05},
    "focal": {"focal_gamma": 3.0},
    "mixup": {"mixup_alpha": 1.0},
    "mmce": {"mmce_lam": 2.0},
    "fedlas-ls": {"fedlas_ls_alpha": 0.05, "fedlas_ls_beta": 4.0},
    "ce+maccal": {"maccal_r": 256, "maccal_q0": 0.9},
    "csm+maccal": {"maccal_r": 256, "maccal_q0": 0.9},
}
# a field's letter in run names: tune-csm-w0p5-s2p3, tune-ls-a0p05, tune-ce-r128-q0p7-maccal
LETTERS = {
    "weight_decay": "wd",
    "csm_weight": "w", "csm_sharpening": "s", "ls_alpha": "a", "focal_gamma": "g",
    "mixup_alpha": "a", "mmce_lam": "l", "fedlas_ls_alpha": "a", "fedlas_ls_beta": "b",
    "maccal_r": "r", "maccal_q0": "q",
}  # fmt: skip
# where an extension step stops: q0 is a retention probability within the finetune preset's
# [maccal_q_min, maccal_q_max] = [0.3, 1]; r is a whole number of units
LIMITS: dict[str, tuple[float, float]] = {"maccal_q0": (0.3, 1.0), "maccal_r": (1, math.inf)}
INTEGERS = ("maccal_r",)
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


def tune_run(group: str, point: dict[str, float] | str, seed: int = TUNE_SEED) -> str:
    """The tuning run's folder name (no dots in run names): tune-<group>-<letter><value>...
    for a grid point, tune-<group>-ext-<letter> for an extension (`point`: the parameter), with
    -t<seed> after it at every seed but TUNE_SEED; MaC-Cal's is its fine-tuning,
    tune-<base>-...-maccal (tuning_alias: the train run it reads)."""
    if isinstance(point, str):
        tail = f"ext-{LETTERS[point]}"
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
    role: str = "grid"  # grid | ext (one step beyond the grid's edge)
    stage_dir: str = "train"  # where its run lands: train | finetune
    point: dict[str, float] = field(default_factory=dict)  # a grid point's values
    param: str = ""  # ext: the parameter it steps out
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


def _rows(
    root: Path, tasks: Sequence[TuneTask], points: dict[str, dict[str, float]]
) -> list[dict[str, Any]]:
    """One row per point (`points`: {key: its values}, in order): its values, the mean of each
    score over its seeds, its val NLL per seed and its runs."""
    by_key: dict[str, list[TuneTask]] = defaultdict(list)
    for t in tasks:
        by_key[t.key].append(t)
    rows = []
    for key, point in points.items():
        runs = sorted(by_key[key], key=lambda t: t.seed)
        scores = [score(root, t) for t in runs]
        row = score_row(key, point, scores, [t.name for t in runs])
        rows.append({**row, "extension": runs[0].role == "ext"})
    return rows


def _grid_choice(root: Path, tasks: Sequence[TuneTask]) -> dict[str, Any]:
    """The rule over the grid's points alone (what decides the extensions)."""
    grid = [t for t in tasks if t.role == "grid"]
    points = {t.key: t.point for t in grid}
    return choose_point(_rows(root, grid, points), REFERENCE[tasks[0].group])["chosen"]


def step_out(values: Sequence[float], chosen: float, param: str) -> float | None:
    """The extension of a parameter whose chosen value is the smallest or largest of `values`:
    one geometric step outward, chosen² / its neighbour in the grid (within LIMITS, 3 significant
    digits, whole for INTEGERS); None for an interior choice or a step the limits leave at
    `chosen`."""
    ordered = sorted(values)
    if len(ordered) < 2 or ordered[0] < chosen < ordered[-1]:
        return None
    neighbour = ordered[1] if chosen == ordered[0] else ordered[-2]
    lo, hi = LIMITS.get(param, (0.0, math.inf))
    new = min(max(chosen * chosen / neighbour, lo), hi)
    new = round(new) if param in INTEGERS else float(f"{new:.3g}")
    return None if new == chosen else new


def extension_point(root: Path, tasks: Sequence[TuneTask], param: str) -> dict[str, float] | None:
    """The point an extension task runs: the grid's choice with `param` one step beyond the
    edge; None when the grid's choice of `param` is interior (the task has nothing to do)."""
    group = tasks[0].group
    best = _grid_choice(root, tasks)
    new = step_out(GRIDS[group][param], best[param], param)
    return None if new is None else {**{k: best[k] for k in GRIDS[group]}, param: new}


def choose(root: Path, tasks: Sequence[TuneTask]) -> dict[str, Any]:
    """A group's choice by the rule over its grid and the extensions its grid's choice asked
    for: every point's scores (means over the tuning seeds), whether it extended, which
    parameter to which value ({} when the grid's choice was interior), and the rule's numbers."""
    group = tasks[0].group
    points = {t.key: t.point for t in tasks if t.role == "grid"}
    extended = {}
    for t in tasks:
        if t.role != "ext" or t.key in points:
            continue
        if (point := extension_point(root, tasks, t.param)) is not None:
            extended[t.param] = point[t.param]
            points[t.key] = point
    rows = _rows(root, [t for t in tasks if t.key in points], points)
    rule = choose_point(rows, REFERENCE[group])
    chosen = rule.pop("chosen")
    return {
        "criterion": "mean val_nll over the tuning seeds; within one standard error: reference",
        "seeds": sorted({t.seed for t in tasks}),
        "reference": REFERENCE[group],
        "rule": rule,
        "chosen": {k: chosen[k] for k in GRIDS[group]},
        "chosen_run": chosen["run"],
        "chosen_runs": chosen["runs"],
        "extended": extended,
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


# a grid parameter's path in the config tree (`csm_weight`: loss.csm.weight); the grids, run names
# and study.json keep the flat names config.json records (the configs' LEGACY)
PATHS = {**train_config.Config.LEGACY, **finetune_config.Config.LEGACY}


def set_values(values: dict[str, float]) -> list[str]:
    """`--set` values of grid parameters, each under its path in the config tree."""
    return [f"{PATHS.get(k, k)}={v:g}" for k, v in values.items()]


def base_run(root: Path, tuned: dict[str, list[TuneTask]], group: str, seed: int) -> str:
    """The train run a MaC-Cal group's run at tuning seed `seed` fine-tunes: its base method's
    chosen point's run at that seed (paired: every point's seed k starts from the same run)."""
    runs = choose(root, tuned[NEEDS[group]])["chosen_runs"]
    return runs[seed - TUNE_SEED]
