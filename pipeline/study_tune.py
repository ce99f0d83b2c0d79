"""`make study`'s tuning: every method's own hyper-parameters chosen on the validation split,
from a grid of the same size (METHODS §8 "One tuning budget"; docs/study.md).

GRIDS declares one grid per tuning group, {train or finetune field: values}: 4 points each (2 x 2
for a two-parameter method, 4 values for a one-parameter one), centred on the published defaults
(METHODS §3-6). A grid point is one run with seed TUNE_SEED (no study seed: a tuning run is never
a study run); its score is the val NLL at the run's chosen checkpoint: a train run's best-val-
accuracy epoch (the checkpoint it keeps), a fine-tuning's last epoch (it keeps its last weights).
NLL because it rewards accuracy and calibration at once; no tuning run is evaluated, so the test
split is never read for it. Ties: the first point in grid order.

Groups: csm's (w x s) serves the whole 2-way csm family (csm, csm-ratio, csm-ce, csm-redraw);
csm3 tunes s at csm's chosen w on its own k = 3 set; ls, focal, mixup, mmce and fedlas-ls their
loss parameters; ce+maccal and csm+maccal MaC-Cal's r and q0, one grid each on its own base run:
a `tune-ce` train run (ce has no hyper-parameters) and csm's chosen grid run (already a csm run at
the chosen w, s with TUNE_SEED). One grid each because the best head for a ce backbone need not
be the best for a csm one, and each method then gets the 4 points every other method gets.
MaC-Cal writes finetune/<run>-maccal, so each of its points fine-tunes its own name of the base:
train/tune-ce-r128-q0p7 is a hard-linked copy of train/tune-ce (study_kway.link_complete) and its
fine-tuning is finetune/tune-ce-r128-q0p7-maccal.

Edge rule, once: a chosen value that is the smallest or largest of its grid values gets one more
run, task tune-<group>-ext-<p> (MaC-Cal: tune-<base>-ext-<p>-maccal), one geometric step outward
(v²/neighbour: v·(v/neighbour) above the max, v/(neighbour/v) below the min), the group's other
parameters at their chosen values; then the choice is made again over all the group's runs. An
interior choice leaves the task nothing to do: its prepare returns None and the study skips it.
A method's runs take the final choice through their task's prepare, so they wait for the
extension tasks too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.io import read_json
from pipeline.chain import split_sets
from pipeline.study_config import METHODS, StudyConfig, Task
from pipeline.study_kway import link_complete, variant_root
from shards.manifest import is_complete

TUNE_SEED = 100  # no study seed: a tuning run is never a study run
POINTS = 4  # every group's grid size: the same tuning budget for every method (METHODS §8)

# MaC-Cal's r = 256 and q0 = 0.9 are METHODS §4's GUESS defaults: each with one step below
MACCAL_GRID: dict[str, tuple[float, ...]] = {"maccal_r": (128, 256), "maccal_q0": (0.7, 0.9)}
# group -> {train or finetune field: values}; a group is named after the method it tunes
GRIDS: dict[str, dict[str, tuple[float, ...]]] = {
    # w = 1 (the reference code), w / 2; s = 4 (CIFAR-10, Tiny) and 2.3 (CIFAR-100), METHODS §2-3
    "csm": {"csm_weight": (0.5, 1.0), "csm_sharpening": (2.3, 4.0)},
    # s at csm's chosen w: a k = 3 vertex target as sharp as k = 2's at s = 4 needs s ≈ 5.4 (x1.35,
    # docs/study.md); a x1.35 ladder around it also holds k = 3's match of s = 2.3 (≈ 3.1)
    "csm3": {"csm_sharpening": (3.0, 4.0, 5.4, 7.3)},
    # α = 0.05 (CIFAR-10, Tiny) and 0.1 (CIFAR-100) of METHODS §5, x2 steps either side
    "ls": {"ls_alpha": (0.02, 0.05, 0.1, 0.2)},
    # γ = 3 (METHODS §6), 5 (FLSD-53's high γ), 1 and 2 (the rest of Mukhoti et al.'s grid)
    "focal": {"focal_gamma": (1.0, 2.0, 3.0, 5.0)},
    # α = 1 (Zhang et al., CIFAR; the preset's GUESS), 0.2 (ImageNet), 0.1-0.4 (Thulasidasan et
    # al.'s calibration study)
    "mixup": {"mixup_alpha": (0.1, 0.2, 0.4, 1.0)},
    # λ = 2 (METHODS §6, the focal-calibration code), x2 steps
    "mmce": {"mmce_lam": (1.0, 2.0, 4.0, 8.0)},
    # α = 0.05 (CIFAR-10, Tiny) and 0.1 (CIFAR-100), β = 4 and 4 / 2 (METHODS §5)
    "fedlas-ls": {"fedlas_ls_alpha": (0.05, 0.1), "fedlas_ls_beta": (2.0, 4.0)},
    "ce+maccal": MACCAL_GRID,
    "csm+maccal": MACCAL_GRID,
}
# a field's letter in run names: tune-csm-w0p5-s2p3, tune-ls-a0p05, tune-ce-r128-q0p7-maccal
LETTERS = {
    "csm_weight": "w", "csm_sharpening": "s", "ls_alpha": "a", "focal_gamma": "g",
    "mixup_alpha": "a", "mmce_lam": "l", "fedlas_ls_alpha": "a", "fedlas_ls_beta": "b",
    "maccal_r": "r", "maccal_q0": "q",
}  # fmt: skip
# where an extension step stops: q0 is a retention probability within the finetune preset's
# [maccal_q_min, maccal_q_max] = [0.3, 1]; r is a whole number of units
LIMITS: dict[str, tuple[float, float]] = {"maccal_q0": (0.3, 1.0), "maccal_r": (1, math.inf)}
INTEGERS = ("maccal_r",)
# a group whose runs need another group's choice: csm3 its w, csm+maccal its chosen run (base)
NEEDS = {"csm3": "csm", "csm+maccal": "csm"}


def tuning_group(method: str) -> str:
    """The grid that tunes a method: csm's for the 2-way csm family, csm3's for the k = 3 set,
    the method's own (GRIDS) for the others; "" for one with nothing to tune (ce)."""
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


def tune_run(group: str, point: dict[str, float] | str) -> str:
    """The tuning run's folder name (no dots in run names): tune-<group>-<letter><value>...
    for a grid point, tune-<group>-ext-<letter> for an extension (`point`: the parameter);
    MaC-Cal's is its fine-tuning, tune-<base>-...-maccal (tuning_alias: the train run it reads)."""
    if isinstance(point, str):
        tail = f"ext-{LETTERS[point]}"
    else:
        tail = "-".join(f"{LETTERS[k]}{v:g}" for k, v in point.items()).replace(".", "p")
    m = METHODS[group]
    return f"tune-{m.base}-{tail}-maccal" if m.stage == "finetune" else f"tune-{group}-{tail}"


def tuning_alias(name: str) -> str:
    """The train run a MaC-Cal tuning run fine-tunes: its own copy of the base run."""
    return name.removesuffix("-maccal")


def grid_points(group: str) -> list[dict[str, float]]:
    """Every point of a group's grid, the first parameter slowest."""
    points: list[dict[str, float]] = [{}]
    for key, values in GRIDS[group].items():
        points = [{**p, key: v} for p in points for v in values]
    return points


@dataclass
class TuneTask(Task):
    group: str = ""
    role: str = "grid"  # grid | ext (one step beyond the grid's edge) | base (tune-ce)
    stage_dir: str = "train"  # where its run lands: train | finetune
    point: dict[str, float] = field(default_factory=dict)  # a grid point's values
    param: str = ""  # ext: the parameter it steps out


# ---------------------------------------------------------------- scores and the choice


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


def _best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return min(rows, key=lambda r: r["val_nll"])  # ties: the first


def _grid_rows(root: Path, tasks: Sequence[TuneTask]) -> list[dict[str, Any]]:
    return [
        {"run": t.name, **t.point, **score(root, t), "extension": False}
        for t in tasks
        if t.role == "grid"
    ]


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
    best = _best(_grid_rows(root, tasks))
    new = step_out(GRIDS[group][param], best[param], param)
    return None if new is None else {**{k: best[k] for k in GRIDS[group]}, param: new}


def choose(root: Path, tasks: Sequence[TuneTask]) -> dict[str, Any]:
    """A group's choice: the point of the lowest val NLL over its grid and the extensions its
    grid's choice asked for; every point's scores and whether it extended, which parameter to
    which value ({} when the grid's choice was interior)."""
    group = tasks[0].group
    rows, extended = _grid_rows(root, tasks), {}
    for t in tasks:
        if t.role == "ext" and (point := extension_point(root, tasks, t.param)) is not None:
            extended[t.param] = point[t.param]
            rows.append({"run": t.name, **point, **score(root, t), "extension": True})
    best = _best(rows)
    return {
        "criterion": "val_nll",
        "chosen": {k: best[k] for k in GRIDS[group]},
        "chosen_run": best["run"],
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
    return [f"{k}={v:g}" for k, v in values.items()]


def base_run(root: Path, tuned: dict[str, list[TuneTask]], group: str) -> str:
    """The train run a MaC-Cal group fine-tunes: its base method's chosen grid run (csm), or
    the base's own tuning run (tune-ce) when it has nothing to tune."""
    base = METHODS[group].base
    base_group = tuning_group(base)
    return choose(root, tuned[base_group])["chosen_run"] if base_group else f"tune-{base}"


# ---------------------------------------------------------------- the tasks


def _prepare_extension(
    root: Path, tasks: list[TuneTask], param: str, fixed: Callable[[], list[str]] | None
) -> list[str] | None:
    """An extension task's --set values, or None when its grid's choice is interior."""
    point = extension_point(root, tasks, param)
    if point is None:
        return None
    return [*(fixed() if fixed else []), *(f"{k}={v:g}" for k, v in point.items())]


def _prepare_finetune(
    root: Path,
    tuned: dict[str, list[TuneTask]],
    group: str,
    name: str,
    values: Callable[[], list[str] | None] | None,
) -> list[str] | None:
    """Before a MaC-Cal tuning run: its own name for the base run (hard links), then its
    values (None: an extension with nothing to do, and no copy)."""
    sets = values() if values else []
    if sets is not None:
        link_complete(root / "train" / base_run(root, tuned, group), root / "train" / name)
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
) -> list[TuneTask]:
    """A group's tasks: its grid, one extension task per parameter, and (ce+maccal) the base
    train run its grid fine-tunes."""
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
    elif stage == "finetune":  # a base run of its own at TUNE_SEED: ce has nothing to tune
        base = f"tune-{m.base}"
        sets = [*train_sets, *METHODS[m.base].sets, f"run={base}", f"seed={TUNE_SEED}"]
        done = is_complete(root / "train" / base)
        tasks.append(TuneTask(base, [("train", sets)], set(), done, group=group, role="base"))
        after.add(base)

    def make(name: str, values: list[str], role: str, prepare, **kw) -> TuneTask:
        if stage == "finetune":
            run = tuning_alias(name)
            sets = [*ft_sets, *m.sets, *values, f"run={run}", f"seed={TUNE_SEED}"]
            prepare = functools.partial(_prepare_finetune, root, tuned, group, run, prepare)
        else:
            sets = [*train_sets, *m.sets, *extra, *values, f"run={name}", f"seed={TUNE_SEED}"]
        done = is_complete(root / stage / name)
        return TuneTask(
            name, [(stage, sets)], set(after), done, prepare,
            group=group, role=role, stage_dir=stage, **kw,
        )  # fmt: skip

    grid = [
        make(tune_run(group, p), [f"{k}={v:g}" for k, v in p.items()], "grid", fixed, point=p)
        for p in grid_points(group)
    ]
    tasks += grid
    after |= {t.name for t in grid}  # an extension: the whole grid first, it decides the step
    for param in GRIDS[group]:
        prepare = functools.partial(_prepare_extension, root, tasks, param, fixed)
        tasks.append(make(tune_run(group, param), [], "ext", prepare, param=param))
    for t in tasks:
        if t.role == "ext":
            t.done = _extension_done(root, tasks, t)
    return tasks


def tuning_tasks(cfg: StudyConfig, root: Path, sets: Sequence[str]) -> dict[str, list[TuneTask]]:
    """The tasks of every group the study's methods need ({group: tasks}, in the order they
    run: csm before csm3 and csm+maccal). Grid runs read the val split only (never evaluated)."""
    groups = dict.fromkeys(g for method in cfg.methods for g in plan_groups(method))
    train_sets, ft_sets = split_sets(sets, "train"), split_sets(sets, "finetune")
    tuned: dict[str, list[TuneTask]] = {}
    for group in groups:
        tuned[group] = _group_tasks(group, root, train_sets, ft_sets, tuned)
    return tuned


def tuning_report(cfg: StudyConfig, root: Path, sets: Sequence[str]) -> dict[str, Any]:
    """Every group's grid, extensions and choice, as the study's runs were given them
    (study.json "tuning"): csm3 adds the csm w it ran at ("at"), a MaC-Cal group its base run."""
    tuned = tuning_tasks(cfg, root, sets)
    report: dict[str, Any] = {}
    for group, tasks in tuned.items():
        result = {"params": {k: list(v) for k, v in GRIDS[group].items()}, **choose(root, tasks)}
        if group == "csm3":
            result["at"] = {"csm_weight": choose(root, tuned["csm"])["chosen"]["csm_weight"]}
        if METHODS[group].stage == "finetune":
            result["base"] = base_run(root, tuned, group)
        report[group] = result
    return report
