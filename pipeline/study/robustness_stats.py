"""The robustness table's statistics: every study run evaluated under shift (the corrupted test
split of the `shift` stage, 5 severities) and on far-OOD sets (the `ood` stage), compared paired
by seed and by test image as in the main table.

The study plans two more tasks before its runs' evaluations (pipeline/study/plan.py,
`robustness_tasks`), `shift` (the first SHIFT_IMAGES test images under every corruption and
severity) and `ood` (OOD_SETS), and each run's evaluate step reads them (`corruptions=`, `ood=`).
A run whose evaluation did not read them is evaluated again (its training is kept). Each record
of study.json carries (pipeline/study/records.py, `robustness_entries`)

    shift: {before_ts|after_ts: {"1".."5": {ece, nll, brier, top1}},   the mean over corruptions
            per_corruption: {before_ts|after_ts: {corruption: {"1".."5": {...}}}}}
    ood:   {<set>: {auroc, fpr95, aupr_in, aupr_out, auroc_after_ts}}  (max-softmax score)

and study.json's `shift_paired` holds the paired bootstrap of the mean over corruptions and
severities SEVERE of ECE and NLL (the logits evaluate keeps in predictions.npz), each method
against ce, before and after TS, with the margins of the main table (this module). The table is
report.md's section (pipeline/study/robustness_report.py), shift.png its figure
(pipeline/study/figures.py, `shift_figure`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.seeding import derive_seed
from pipeline.study.intervals import mixed_sets_of
from pipeline.study.stats import N_BINS, Predictions, paired_difference, softmax
from shards import evals

SEVERE = (3, 4, 5)  # the severities the verdict reads (MaC-Cal's Fig. 5 separates methods there)
SHIFT_METRICS = ("ece", "nll")


@dataclass(frozen=True)
class ShiftPredictions:
    """One run's predictions on the SEVERE corrupted sets (every corruption x severity, the
    same N test images in each): the metrics of pipeline.study.stats.Predictions, each the mean
    over the sets, on the images `idx` of every set at once."""

    bins: np.ndarray  # [K, N] confidence bin of each image in each set
    gap: np.ndarray  # [K, N] 1[correct] − confidence
    nlls: np.ndarray  # [K, N]
    labels: np.ndarray  # [N]

    @classmethod
    def load(cls, path: Path, temperature: float) -> ShiftPredictions:
        with np.load(path, allow_pickle=False) as z:
            logits, labels = z["corruption_logits"], z["corruption_labels"]
        sets = logits[:, [s - 1 for s in SEVERE]].reshape(-1, *logits.shape[2:])
        preds = [Predictions.from_logits(lg, labels, temperature) for lg in sets]
        return cls(
            *(np.stack([getattr(p, f) for p in preds]) for f in ("bins", "gap", "nlls")), labels
        )

    def ece(self, idx: np.ndarray | None = None) -> float:
        bins, gap = (self.bins, self.gap) if idx is None else (self.bins[:, idx], self.gap[:, idx])
        k, n = gap.shape
        offset = (np.arange(k)[:, None] * N_BINS + bins).ravel()  # one bincount for all sets
        sums = np.bincount(offset, weights=gap.ravel(), minlength=k * N_BINS).reshape(k, N_BINS)
        return float(np.abs(sums).sum() / (k * n))

    def nll(self, idx: np.ndarray | None = None) -> float:
        return float((self.nlls if idx is None else self.nlls[:, idx]).mean())


@dataclass(frozen=True)
class OODPredictions:
    """One run's max-softmax scores (before TS) on the test split and one OOD set, as one
    sample of N_test + N_ood images (ID first) that the paired bootstrap resamples like test
    images: every run scores the same images in the same order. `auroc_shortfall(idx)` is
    1 − AUROC (ID = positive, ties counted half) on the images `idx`, counted with their
    multiplicity, in O(N) from tie groups sorted once."""

    group: np.ndarray  # [N] rank of each image's score among the distinct scores (ascending)
    is_id: np.ndarray  # [N] 1.0 for a test image, 0.0 for an OOD one
    labels: np.ndarray  # [N] test labels, then −1 for the OOD images (pairing check only)

    @classmethod
    def load(cls, path: Path, ood_set: str) -> OODPredictions:
        with np.load(path, allow_pickle=False) as z:
            test, ood, labels = z["logits"], z[evals.ood_logits_key(ood_set)], z["labels"]
        scores = np.concatenate([softmax(test).max(axis=1), softmax(ood).max(axis=1)])
        _, group = np.unique(scores, return_inverse=True)
        is_id = np.concatenate([np.ones(len(test)), np.zeros(len(ood))])
        return cls(group, is_id, np.concatenate([labels, np.full(len(ood), -1)]))

    def auroc_shortfall(self, idx: np.ndarray | None = None) -> float:
        n = len(self.group)
        w = np.ones(n) if idx is None else np.bincount(idx, minlength=n).astype(float)
        g = int(self.group.max()) + 1
        pos = np.bincount(self.group, weights=w * self.is_id, minlength=g)
        neg = np.bincount(self.group, weights=w * (1.0 - self.is_id), minlength=g)
        below = np.cumsum(neg) - neg  # OOD weight strictly below each score
        auroc = float(pos @ (below + 0.5 * neg)) / float(pos.sum() * neg.sum())
        return 1.0 - auroc


def ood_paired(
    root: Path,
    records: list[dict[str, Any]],
    methods: Sequence[str],
    n: int,
    rng: Callable[..., np.random.Generator],
) -> dict[str, dict[str, dict[str, Any]]]:
    """{set: {method: paired_difference}} of 1 − AUROC (max softmax, before TS), each method
    against ce on each OOD set, paired by seed and by image (test and OOD images resampled
    together); `rng("ood", set, method, "ce")` as the other comparisons'."""
    sets = list(dict.fromkeys(s for r in records for s in r.get("ood", {})))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for ood_set in sets:
        runs: dict[str, dict[int, OODPredictions]] = {}
        for r in records:
            path = root / evals.EVAL / r["run"] / evals.PREDICTIONS
            runs.setdefault(r["method"], {})[r["seed"]] = OODPredictions.load(path, ood_set)
        for m in methods:
            if m != "ce" and m in runs and "ce" in runs:
                g = rng("ood", ood_set, m, "ce")
                out.setdefault(ood_set, {})[m] = paired_difference(
                    runs,
                    m,
                    "ce",
                    n,
                    g,
                    "auroc_shortfall",  # type: ignore[arg-type]
                    mixed_sets=mixed_sets_of(records),
                )
    return out


def comparisons(methods: Sequence[str]) -> list[tuple[str, str, str, str]]:
    """(when, metric, method, reference): every method against ce after TS (ECE and NLL: the
    post-hoc fix is what shift undoes), and csm against ce before TS too."""
    out = [("after_ts", k, m, "ce") for m in methods if m != "ce" for k in SHIFT_METRICS]
    return out + ([("before_ts", "ece", "csm", "ce")] if "csm" in methods else [])


def shift_rng(*key: str) -> np.random.Generator:
    """The generator of one comparison under shift: (when, metric, method, reference)."""
    return np.random.default_rng(derive_seed(0, "study-shift", *key))


def shift_paired(
    root: Path,
    records: list[dict[str, Any]],
    wanted: Sequence[tuple[str, str, str, str]],
    n: int,
    rng: Callable[..., np.random.Generator],
) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """{when: {metric: {reference: {method: paired_difference}}}} on the SEVERE sets for each
    (when, metric, method, reference) of `wanted`; `rng(when, metric, method, reference)` as
    the main table's."""
    runs: dict[str, dict[str, dict[int, ShiftPredictions]]] = {"before_ts": {}, "after_ts": {}}
    for r in records:
        path = root / evals.EVAL / r["run"] / evals.PREDICTIONS
        for when, t in (("before_ts", 1.0), ("after_ts", r["temperature"])):
            runs[when].setdefault(r["method"], {})[r["seed"]] = ShiftPredictions.load(path, t)
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for when, metric, method, reference in wanted:
        g = rng(when, metric, method, reference)
        mixed = mixed_sets_of(records)
        result = paired_difference(runs[when], method, reference, n, g, metric, mixed_sets=mixed)  # type: ignore[arg-type]
        out.setdefault(when, {}).setdefault(metric, {}).setdefault(reference, {})[method] = result
    return out
