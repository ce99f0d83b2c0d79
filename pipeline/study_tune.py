"""`make study`'s choice of CSM's weight w and sharpening s, on the validation split only.

A small grid of csm runs with a seed no study run uses (TUNE_SEED); each run's score is read
from its own metrics.json: the validation NLL at its chosen checkpoint (the epoch of its best
val accuracy). NLL because it rewards accuracy and calibration at once, and the test split is
never read for it. The k-way set (csm3) gets its own s grid at the w chosen for csm: a k = 3
vertex target as sharp as k = 2's needs s ≈ 5.4 instead of 4 (docs/study.md).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.io import read_json
from pipeline.study_config import METHODS, StudyConfig, Task
from pipeline.study_kway import variant_root

TUNE_SEED = 100  # no study seed: a tuning run is never a study run


def tune_run(method: str, weight: float | None, sharpening: float) -> str:
    """The tuning run's folder name, e.g. tune-csm-w0p5-s2p3 (no dots in run names); no w part
    for a grid at another grid's chosen w."""
    w = "" if weight is None else f"-w{weight:g}"
    return f"tune-{method}{w}-s{sharpening:g}".replace(".", "p")


def grid(
    method: str, weights: Sequence[float | None], sharpenings: Sequence[float]
) -> list[tuple[str, float | None, float]]:
    """(run, w, s) of every grid point."""
    return [(tune_run(method, w, s), w, s) for w in weights for s in sharpenings]


def val_score(run: Path) -> dict[str, float]:
    """Validation accuracy, ECE and NLL at the run's chosen checkpoint (best val accuracy)."""
    train = read_json(run / "metrics.json")["train"]
    best = next(h for h in train["history"] if h["val_acc"] == train["best_val_acc"])
    return {k: round(float(best[k]), 4) for k in ("val_acc", "val_ece", "val_nll")}


def choose(train_dir: Path, points: list[tuple[str, float | None, float]]) -> dict[str, Any]:
    """The grid point of the lowest validation NLL (ties: the first), with every point's
    scores: {"chosen": {"csm_weight", "csm_sharpening"}, "grid": [...]}."""
    rows = [
        {"run": run, "csm_weight": w, "csm_sharpening": s, **val_score(train_dir / run)}
        for run, w, s in points
    ]
    best = min(rows, key=lambda r: r["val_nll"])
    return {
        "criterion": "val_nll",
        "chosen": {"csm_weight": best["csm_weight"], "csm_sharpening": best["csm_sharpening"]},
        "grid": rows,
    }


def tuning_group(method: str) -> str:
    """Which grid chooses a method's w and s: csm's for the 2-way csm family, csm3's for the
    k = 3 set, none for the others."""
    m = METHODS[method]
    if m.stage != "train" or "loss=csm" not in m.sets:
        return ""
    return f"csm{m.mix_classes}" if m.mix_classes > 2 else "csm"


@dataclass
class TuneTask(Task):
    point: tuple[float | None, float] = (None, 0.0)  # (w, s); w None: csm's chosen one


def tuning_tasks(cfg: StudyConfig, root: Path, train_sets: Sequence[str]) -> dict[str, list]:
    """The grid runs of each tuning group the methods need: csm's (w x s), and csm3's (s, at the
    w chosen for csm, so after csm's grid). They read the val split only."""
    groups = {tuning_group(m) for m in cfg.methods} - {""}
    if not groups:
        return {}

    def task(run: str, w: float | None, s: float, after: set, extra: Sequence[str], prepare=None):
        sets = [*train_sets, "loss=csm", f"csm_sharpening={s:g}", *extra]
        sets += [f"run={run}", f"seed={TUNE_SEED}"]
        done = (root / "train" / run / "manifest.json").is_file()
        return TuneTask(run, [("train", sets)], after, done, prepare, point=(w, s))

    out = {
        "csm": [
            task(run, w, s, {"chain"}, [f"csm_weight={w:g}"])
            for run, w, s in grid("csm", cfg.tune_weights, cfg.tune_sharpening)
        ]
    }
    if "csm3" in groups:
        after = {"chain-k3", *(t.name for t in out["csm"])}
        mixed = f"mixed={variant_root(root, 'k3') / 'mixed'}"
        pick_w = functools.partial(chosen_sets, root, out, ("csm",), keys=("csm_weight",))
        out["csm3"] = [
            task(run, None, s, set(after), [mixed], pick_w)
            for run, _, s in grid("csm3", (None,), cfg.tune_sharpening_k3)
        ]
    return out


def chosen_sets(
    root: Path,
    tuned: dict[str, list],
    groups: Sequence[str],
    keys: Sequence[str] = ("csm_weight", "csm_sharpening"),
) -> list[str]:
    """--set values chosen on val: csm's w and s (groups ("csm",)), or csm's w with csm3's s
    (("csm", "csm3")); `keys` keeps only those (csm3's grid runs take csm's w, not its s)."""
    values: dict[str, float] = {}
    for group in groups:
        points = [(t.name, *t.point) for t in tuned[group]]
        chosen = choose(root / "train", points)["chosen"]
        values |= {k: v for k, v in chosen.items() if v is not None and k in keys}
    return [f"{k}={v:g}" for k, v in values.items()]


def tuning_report(cfg: StudyConfig, root: Path, train_sets: Sequence[str]) -> dict[str, Any]:
    """Every grid's points and choice, as the study's runs were given them (study.json)."""
    tuned = tuning_tasks(cfg, root, train_sets)
    return {
        group: choose(root / "train", [(t.name, *t.point) for t in tasks])
        for group, tasks in tuned.items()
    }
