"""What a study reads from its runs' folders: one record per (method, seed) from its evaluation
(eval/<stage>/<run>/metrics.json, the run's labelled budget, the best post-hoc calibrator, the
robustness entries), and each record's test predictions for the paired statistics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from core.io import read_json
from pipeline.study.config import METHODS, METRICS, POSTHOC, StudyConfig, run_name
from pipeline.study.stats import Predictions
from shards import evals
from stages.common.budget import labelled_split_images


def collect(cfg: StudyConfig, root: Path) -> list[dict[str, Any]]:
    records = []
    for method in cfg.methods:
        stage_dir = "finetune" if METHODS[method].stage == "finetune" else "train"
        for seed in cfg.seeds_of(method):
            folder = evals.eval_dir(root, stage_dir, run_name(method, seed))
            ev = evals.read_metrics(folder)["evaluation"]
            train = recorded_budget(root / stage_dir / folder.name)
            records.append(
                {
                    "method": method,
                    "seed": seed,
                    # the csm family's generator fit and its mixed set (StudyConfig.fit_of,
                    # mixed_set); None: it reads none
                    "fit": cfg.fit_of(method, seed),
                    "mixed_set": cfg.mixed_set(method, seed),
                    "run": f"{stage_dir}/{folder.name}",
                    "labelled_images": labelled_split_images(root, train),
                    "labelled_train_images": train,
                    "temperature": ev["temperature"],
                    "ts_criterion": ev["ts_criterion"],
                    "temperature_on_edge": ev["temperature_on_edge"],
                    "before_ts": {k: ev["before_ts"][k] for k in METRICS},
                    "after_ts": {k: ev["after_ts"][k] for k in METRICS},
                    **posthoc_entries(ev),
                    **(robustness_entries(ev) if cfg.robustness else {}),
                }
            )
    return records


def posthoc_entries(ev: dict[str, Any]) -> dict[str, Any]:
    """The best post-hoc calibrator on val (models/posthoc.py), for the baseline ce + it; {} for
    an evaluation made before evaluate fitted them."""
    if "posthoc" not in ev:
        return {}
    best = ev["posthoc"]["best"]
    return {
        "posthoc_method": best,
        "after_posthoc": {k: ev["posthoc"]["after"][best][k] for k in METRICS},
    }


def robustness_entries(ev: dict[str, Any]) -> dict[str, Any]:
    """The `shift` and `ood` entries of a study record, from an evaluation's metrics."""
    corr = ev["corruptions"]
    shift = {when: corr[when]["mean"] for when in ("before_ts", "after_ts")}
    shift["per_corruption"] = {
        when: {c: v for c, v in corr[when].items() if c != "mean"}
        for when in ("before_ts", "after_ts")
    }
    ood = {
        name: {
            "auroc": s["before_ts"]["msp_auroc"],
            "fpr95": s["before_ts"]["msp_fpr95"],
            "aupr_in": s["before_ts"].get("msp_aupr_in"),
            "aupr_out": s["before_ts"].get("msp_aupr_out"),
            "auroc_after_ts": s["after_ts"]["msp_auroc"],
        }
        for name, s in ev.get("ood", {}).items()
    }
    return {"shift": shift, "ood": ood}


def recorded_budget(run: Path) -> int | None:
    """The labelled images a run recorded when it was made (metrics.json, stages/common/budget.py);
    None for a run whose metrics.json does not record it (such a fine-tuning read all of
    real/train)."""
    section = "finetune" if run.parent.name == "finetune" else "train"
    return read_json(run / "metrics.json")[section].get("labelled_train_images")


def seed_predictions(
    root: Path, records: list[dict[str, Any]]
) -> dict[str, dict[str, dict[int, Predictions]]]:
    """{"before_ts"|"after_ts": {method: {seed: Predictions}}} from each record's
    predictions.npz; after TS also POSTHOC, the baseline "ce + the best post-hoc calibrator on
    val", from ce's calibrated probabilities (where its evaluation stored them)."""
    by_seed: dict[str, dict[str, dict[int, Predictions]]] = {"before_ts": {}, "after_ts": {}}
    for r in records:
        path = root / evals.EVAL / r["run"] / evals.PREDICTIONS  # r["run"] = <stage>/<run>
        with np.load(path, allow_pickle=False) as z:
            logits, labels = z["logits"], z["labels"]
            probs = z["posthoc_probs"] if "posthoc_probs" in z.files else None
        for when, t in (("before_ts", 1.0), ("after_ts", r["temperature"])):
            p = Predictions.from_logits(logits, labels, t)
            by_seed[when].setdefault(r["method"], {})[r["seed"]] = p
        if r["method"] == "ce" and probs is not None:
            by_seed["after_ts"].setdefault(POSTHOC, {})[r["seed"]] = Predictions.from_probs(
                probs, labels
            )
    return by_seed
