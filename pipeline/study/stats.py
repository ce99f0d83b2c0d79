"""Statistics of a study (pipeline/study/): ECE, debiased ECE and NLL from stored test
predictions, method − reference differences paired by seed and by test image with their
intervals and verdicts (pipeline/study/intervals.py) against the margins, primary endpoints and
relative goal a protocol names (pipeline/study/endpoints.py), and mean ± std over seeds.

No file I/O: the caller loads predictions.npz and passes arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.study.endpoints import DEFAULT, Endpoints
from pipeline.study.endpoints import MARGINS as MARGINS  # the margins' home: endpoints.py
from pipeline.study.intervals import intervals, units_of

N_BINS = 15  # equal-width bins ((m-1)/15, m/15], as evaluate uses
METRICS = ("ece", "debiased_ece", "nll")  # each the name of a Predictions method
# OOD detection, lower is better like every metric here: 1 − AUROC of the max softmax (ID =
# positive), a method of pipeline.study.robustness_stats.OODPredictions
OOD_METRICS = ("auroc_shortfall",)
# ECEs and 1 − AUROC in points (x100), NLL in nats
SCALE = {"ece": 100.0, "debiased_ece": 100.0, "nll": 1.0, "auroc_shortfall": 100.0}
# Test-image blocks of the jackknife that gives BCa's acceleration. Its sampling error is about
# 0.41 / blocks (the skewness of `blocks` values has sd sqrt(6 / blocks), a = skewness /
# (6 sqrt(blocks))): 20 blocks give ±0.02, several times the acceleration of a mean over 10k
# test images (skewness / (6 sqrt(N)) ≈ 0.003); 100 cost 100 evaluations per comparison.
JACKKNIFE_BLOCKS = 100


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


# Why a second binned ECE beside models.calibration.ece (evaluate's, the one a report quotes):
# the bootstrap evaluates the metric once per resample, seed and method (2,000 x seeds x 2 per
# comparison), each time on freshly drawn test images. Here the images are binned once
# (`bins`, `gap`) and a resample is one bincount over the drawn indices; calibration.ece
# recomputes the softmax, the confidences and the bins in float64 torch on every call. On
# 10,000 test images (one thread): 41 µs a resample here, 2.6 ms there with 10 classes (x64),
# 54 µs vs 6.9 ms with 100 (x128), i.e. ~0.5 s vs ~30 s of ECE per 3-seed comparison.
# tests/test_study_stats.py pins the two equal (1e-12) on resampled indices; they differ in
# the last bits (sums in another order), so the study's numbers stay this module's.
@dataclass(frozen=True)
class Predictions:
    """One run's test predictions, reduced to what the bootstraps of its metrics need."""

    bins: np.ndarray  # equal-width bin of each sample's confidence (15 bins)
    gap: np.ndarray  # 1[correct] − confidence
    logits: np.ndarray  # already divided by the temperature
    labels: np.ndarray
    nlls: np.ndarray  # −log p(label) of each sample
    correct: np.ndarray  # 1[argmax = label], float

    FIELDS = ("bins", "gap", "logits", "labels", "nlls", "correct")

    @classmethod
    def from_probs(cls, probs: np.ndarray, labels: np.ndarray) -> Predictions:
        """Predictions from calibrated probabilities (a post-hoc calibrator's): their logs are
        logits whose softmax gives them back (floored at float64's eps, as sklearn's log_loss)."""
        return cls.from_logits(np.log(np.clip(probs, np.finfo(np.float64).eps, 1.0)), labels)

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
        correct = (pred == labels).astype(np.float64)
        return cls(bins, correct - conf, logits, labels, nlls, correct)

    def ece(self, idx: np.ndarray | None = None) -> float:
        """ECE = Σ_bins |Σ_{i in bin} (1[correct_i] − c_i)| / N on the samples `idx`."""
        bins, gap = (self.bins, self.gap) if idx is None else (self.bins[idx], self.gap[idx])
        return float(np.abs(np.bincount(bins, weights=gap, minlength=N_BINS)).sum() / len(gap))

    def debiased_ece(self, idx: np.ndarray | None = None) -> float:
        """sqrt(max(0, Σ_b (n_b/N)·[ḡ_b² − acc_b(1 − acc_b)/(n_b − 1)])) on the samples `idx`.

        The debiased plug-in estimator of the squared (l2) top-label calibration error of Kumar,
        Liang & Ma, "Verified Uncertainty Calibration" (NeurIPS 2019; `unbiased_square_ce` and
        `unbiased_l2_ce` of their `calibration` package): ḡ_b = acc_b − conf_b is bin b's mean gap, and
        acc_b(1 − acc_b)/(n_b − 1) the unbiased estimate of the variance of acc_b, which the
        square ḡ_b² adds in expectation; bins with n_b < 2 add 0. The bins are ECE's 15
        equal-width bins (their package defaults to equal-mass), so the two estimators differ
        only in the bias correction and in l2 versus l1. Clipped at 0 and square-rooted as
        their package reports it: in the units of ECE, but >= the l1 error of the same bins.
        """
        bins = self.bins if idx is None else self.bins[idx]
        gap = self.gap if idx is None else self.gap[idx]
        correct = self.correct if idx is None else self.correct[idx]
        n_b = np.bincount(bins, minlength=N_BINS).astype(np.float64)
        full = n_b >= 2
        n_b = n_b[full]
        mean_gap = np.bincount(bins, weights=gap, minlength=N_BINS)[full] / n_b
        acc = np.bincount(bins, weights=correct, minlength=N_BINS)[full] / n_b
        squared = (n_b * (mean_gap**2 - acc * (1.0 - acc) / (n_b - 1.0))).sum() / len(gap)
        return float(np.sqrt(max(squared, 0.0)))

    def nll(self, idx: np.ndarray | None = None) -> float:
        """Mean −log p(label) on the samples `idx`."""
        return float((self.nlls if idx is None else self.nlls[idx]).mean())


def check_metric(metric: str) -> None:
    if metric not in (*METRICS, *OOD_METRICS):
        raise ValueError(f"metric {metric!r}: choose one of {', '.join(METRICS + OOD_METRICS)}")


def metric_value(p: Predictions, metric: str, idx: np.ndarray | None = None) -> float:
    """`metric` (one of METRICS) of `p` on the samples `idx`, in the units of SCALE."""
    return SCALE[metric] * getattr(p, metric)(idx)


def _pairs(
    runs: dict[str, dict[int, Predictions]], method: str, reference: str
) -> tuple[list[int], list[tuple[Predictions, Predictions]]]:
    """The seeds `method` and `reference` share (a 3-seed ablation pairs with the first 3 of a
    5-seed reference) and each seed's two runs; refused in one line when they share no seed or
    the test labels differ."""
    a, b = set(runs[method]), set(runs[reference])
    if not a & b:
        raise ValueError(
            f"paired bootstrap {method} vs {reference}: no seed in common ({method}: "
            f"{sorted(a)}, {reference}: {sorted(b)}); compare runs that share seeds"
        )
    seeds = sorted(a & b)
    pairs = [(runs[method][s], runs[reference][s]) for s in seeds]
    labels = pairs[0][1].labels
    if any(not np.array_equal(p.labels, labels) for pair in pairs for p in pair):
        raise ValueError(
            f"paired bootstrap {method} vs {reference}: the runs' test labels differ; pairing "
            "by test image needs every run's predictions on the same test set, in one order"
        )
    return seeds, pairs


def _values(
    pairs: Sequence[tuple[Predictions, Predictions]], metric: str, idx: np.ndarray | None
) -> np.ndarray:
    """(pairs, 2): metric(method, seed k, idx) and metric(reference, seed k, idx) for each k."""
    return np.array(
        [[metric_value(a, metric, idx), metric_value(b, metric, idx)] for a, b in pairs]
    )


def _differences(
    pairs: Sequence[tuple[Predictions, Predictions]], metric: str, idx: np.ndarray | None
) -> np.ndarray:
    """metric(method, seed k, idx) − metric(reference, seed k, idx) for each pair k."""
    v = _values(pairs, metric, idx)
    return v[:, 0] - v[:, 1]


def _block_thetas(pairs: Sequence[tuple[Predictions, Predictions]], metric: str) -> np.ndarray:
    """θ_(g) of the delete-one-block jackknife over test images (BCa's acceleration): the
    mean-over-seeds difference without block g, block g the images i with
    i mod JACKKNIFE_BLOCKS = g (interleaved, so a test set sorted by class spreads over every
    block)."""
    n_test = len(pairs[0][0].labels)
    block = np.arange(n_test) % min(JACKKNIFE_BLOCKS, n_test)
    return np.array(
        [_differences(pairs, metric, np.flatnonzero(block != g)).mean() for g in np.unique(block)]
    )


def paired_difference(
    runs: dict[str, dict[int, Predictions]],
    method: str,
    reference: str,
    n: int,
    rng: np.random.Generator,
    metric: str = "ece",
    *,
    mixed_sets: Mapping[str, Mapping[int, Hashable]] | None = None,
    when: str | None = None,
    endpoints: Endpoints = DEFAULT,
) -> dict[str, Any]:
    """The intervals of θ = mean over seeds of metric(method) − metric(reference), paired by
    seed and by test image; `runs`: method -> {seed: Predictions}; `mixed_sets`: {method:
    {seed: mixed set}} where the runs trained on one (the csm family: their mixed sets, or the
    generator fits they come from, are the top-level units: intervals.units_of); `when`
    ("before_ts"/"after_ts") names the endpoint, primary or not; `endpoints`: the protocol's
    primary endpoints, margins and relative goal.

    Each of the `n` test-image resamples draws the images once for every run and gives each
    seed's difference on them; pipeline.study.intervals.intervals turns those into the t
    (primary), hierarchical-bootstrap percentile and BCa intervals and the verdict. Refused when
    the two methods share no seed or their test labels differ. Returns (JSON-serialisable):

    {"metric", "method", "reference", "seeds": [int], "n_test", "resamples",
     "method_mean", "reference_mean", "difference" (θ on every image and seed),
     "relative" (difference / reference_mean; None when that is 0), "relative_ci95_t",
     "relative_ci95_percentile", "relative_ci95" (the relative effect's intervals, on the same
     resamples), "relative_goal": {"below", "met", "fragile"} (the comparison the protocol's
     relative goal names), "primary": bool,
     "units": {"level": "seed" | "mixed_set" | "fit", "groups": [[seed]],
               "sets": [[[seed]]] (level "fit": each fit's mixed sets)},
     "ci95_t", "t": {"se", "df", "units", "unit_variance", "shared_image_variance"},
     "ci95_percentile", "ci95_bca", "bca": {"z0", "acceleration", "blocks", "z0_flagged"},
     "interval": PRIMARY (or "percentile" with one unit), "ci95": that interval,
     "labels": {interval: label}, "verdict_from": [PRIMARY, SECOND], "verdict",
     "margin": the protocol's margin of `metric`,
     "leave_one_out": [{"dropped", "difference", "ci95_t", "ci95_percentile", "verdict",
                        "relative", "goal_met"}], "fragile": a dropped unit flips the verdict}
    """
    check_metric(metric)
    seeds, pairs = _pairs(runs, method, reference)
    n_test = len(pairs[0][1].labels)
    values = np.array([_values(pairs, metric, rng.integers(0, n_test, n_test)) for _ in range(n)])
    resampled = values[:, :, 0] - values[:, :, 1]
    full = _values(pairs, metric, None)
    per_seed = full[:, 0] - full[:, 1]
    units = units_of(seeds, method, reference, mixed_sets)
    goal = endpoints.goal_for(when, metric, method, reference)
    out = intervals(
        per_seed, resampled, units, _block_thetas(pairs, metric), endpoints.margins[metric], rng,
        reference=(full[:, 1], values[:, :, 1]), goal=None if goal is None else goal.below,
    )  # fmt: skip
    out["units"]["groups"] = [[seeds[i] for i in g] for g in units.groups]
    if units.sets:
        out["units"]["sets"] = [[[seeds[i] for i in s] for s in sets] for sets in units.sets]
    means = full.mean(axis=0)
    estimate = float(per_seed.mean())
    return {
        "metric": metric,
        "method": method,
        "reference": reference,
        "seeds": seeds,
        "n_test": n_test,
        "resamples": n,
        "method_mean": float(means[0]),
        "reference_mean": float(means[1]),
        "difference": estimate,
        "relative": estimate / float(means[1]) if means[1] != 0 else None,
        "primary": endpoints.is_primary(when, metric, method, reference),
        **out,
    }


def paired_bootstrap(
    runs: dict[str, dict[int, Predictions]],
    reference: str,
    n: int,
    rng: np.random.Generator,
    metric: str = "ece",
    methods: Sequence[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """{method: paired_difference(runs, method, reference, ...)} for each of `methods` (default:
    every method of `runs` but the reference). Any method can be the reference, e.g.
    paired_bootstrap(runs, "ce+maccal", n, rng, methods=["csm+maccal"])."""
    names = [m for m in runs if m != reference] if methods is None else list(methods)
    return {m: paired_difference(runs, m, reference, n, rng, metric) for m in names}


def compare(
    runs: dict[str, dict[int, Predictions]],
    pairs: Sequence[tuple[str, str]],
    n: int,
    rng: Callable[[str, str, str], np.random.Generator],
    metrics: Sequence[str] = METRICS,
    *,
    mixed_sets: Mapping[str, Mapping[int, Hashable]] | None = None,
    when: str | None = None,
    endpoints: Endpoints = DEFAULT,
) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """{metric: {reference: {method: paired_difference(...)}}} for each (method, reference)
    pair of `pairs` and each of `metrics`; `rng(metric, method, reference)` gives each
    comparison its own generator, so adding a pair or a metric changes no other interval.
    `mixed_sets`, `when` and `endpoints` as paired_difference's."""
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for metric in metrics:
        for method, reference in pairs:
            g = rng(metric, method, reference)
            result = paired_difference(
                runs, method, reference, n, g, metric, mixed_sets=mixed_sets, when=when,
                endpoints=endpoints,
            )  # fmt: skip
            out.setdefault(metric, {}).setdefault(reference, {})[method] = result
    return out


def summarize(
    records: list[dict[str, Any]], metrics: Sequence[str]
) -> dict[str, dict[str, dict[str, float]]]:
    """{method: {"before_ts.ece": {mean, std (sample), n}, ..., "temperature": {...}}} over the
    records' seeds; `metrics` names the keys of each record's before_ts / after_ts (and
    after_posthoc, the best post-hoc calibrator on val, where the records have it)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for method in dict.fromkeys(r["method"] for r in records):
        rows = [r for r in records if r["method"] == method]
        stats = {}
        for when in ("before_ts", "after_ts", "after_posthoc"):
            for metric in metrics if all(when in r for r in rows) else ():
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
