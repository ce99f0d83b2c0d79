"""Statistics of a study (pipeline/study.py): ECE from stored test predictions, a paired
bootstrap of ECE differences over test images and seeds, mean ± std over seeds.

Pure numpy, no file I/O: the caller loads predictions.npz and passes arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

N_BINS = 15  # equal-width bins ((m-1)/15, m/15], as evaluate uses


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


@dataclass(frozen=True)
class Predictions:
    """One run's test predictions, reduced to what the bootstraps of ECE and NLL need."""

    bins: np.ndarray  # equal-width bin of each sample's confidence (15 bins)
    gap: np.ndarray  # 1[correct] − confidence
    logits: np.ndarray  # already divided by the temperature
    labels: np.ndarray
    nlls: np.ndarray  # −log p(label) of each sample

    FIELDS = ("bins", "gap", "logits", "labels", "nlls")

    @classmethod
    def from_logits(
        cls, logits: np.ndarray, labels: np.ndarray, temperature: float = 1.0
    ) -> Predictions:
        logits = np.asarray(logits, dtype=np.float64) / temperature
        labels = np.asarray(labels, dtype=np.int64)
        p = softmax(logits)
        conf, pred = p.max(axis=1), p.argmax(axis=1)
        bins = np.clip(np.ceil(conf * N_BINS).astype(np.int64) - 1, 0, N_BINS - 1)
        z = logits - logits.max(axis=1, keepdims=True)
        nlls = np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(labels)), labels]
        return cls(bins, (pred == labels) - conf, logits, labels, nlls)

    def ece(self, idx: np.ndarray | None = None) -> float:
        """ECE = Σ_bins |Σ_{i in bin} (1[correct_i] − c_i)| / N on the samples `idx`."""
        bins, gap = (self.bins, self.gap) if idx is None else (self.bins[idx], self.gap[idx])
        return float(np.abs(np.bincount(bins, weights=gap, minlength=N_BINS)).sum() / len(gap))

    def nll(self, idx: np.ndarray | None = None) -> float:
        """Mean −log p(label) on the samples `idx`."""
        return float((self.nlls if idx is None else self.nlls[idx]).mean())


def bootstrap_difference(
    runs: dict[str, list[Predictions]],
    reference: str,
    n: int,
    rng: np.random.Generator,
    metric: str = "ece",
) -> dict[str, dict[str, float]]:
    """95 % interval of mean-over-seeds metric(method) − metric(reference); ECE x100, NLL as is.

    Each resample draws the test images with replacement (the same images for every run:
    paired) and, per method, the seeds with replacement: the interval covers test-set and
    seed-to-seed variation together.
    """
    if metric not in ("ece", "nll"):
        raise ValueError(f"bootstrap metric {metric!r}: choose ece or nll")
    scale = 100.0 if metric == "ece" else 1.0
    n_test = len(runs[reference][0].gap)
    diffs: dict[str, list[float]] = {m: [] for m in runs if m != reference}
    for _ in range(n):
        idx = rng.integers(0, n_test, n_test)
        means = {
            m: np.mean(
                [getattr(preds[k], metric)(idx) for k in rng.integers(0, len(preds), len(preds))]
            )
            for m, preds in runs.items()
        }
        for m in diffs:
            diffs[m].append(scale * (means[m] - means[reference]))
    point = {m: scale * np.mean([getattr(p, metric)() for p in preds]) for m, preds in runs.items()}
    return {
        m: {
            "difference": point[m] - point[reference],
            "relative": (point[m] - point[reference]) / point[reference],
            "ci95": [float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))],
        }
        for m, d in diffs.items()
    }


def summarize(
    records: list[dict[str, Any]], metrics: Sequence[str]
) -> dict[str, dict[str, dict[str, float]]]:
    """{method: {"before_ts.ece": {mean, std (sample), n}, ..., "temperature": {...}}} over the
    records' seeds; `metrics` names the keys of each record's before_ts / after_ts."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for method in dict.fromkeys(r["method"] for r in records):
        rows = [r for r in records if r["method"] == method]
        stats = {}
        for when in ("before_ts", "after_ts"):
            for metric in metrics:
                v = np.array([r[when][metric] for r in rows], dtype=float)
                std = float(v.std(ddof=1)) if len(v) > 1 else 0.0
                stats[f"{when}.{metric}"] = {"mean": float(v.mean()), "std": std, "n": len(v)}
        v = np.array([r["temperature"] for r in rows], dtype=float)
        stats["temperature"] = {
            "mean": float(v.mean()),
            "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
            "n": len(v),
        }
        out[method] = stats
    return out
