"""The study's statistics on constructed inputs with a known answer: the metrics, the seed- and
image-paired comparisons and their intervals (the intervals themselves, their coverage and the
verdicts: tests/test_study_intervals.py), the debiased ECE."""

import dataclasses
import json
from statistics import NormalDist

import numpy as np
import pytest
import torch

from models.calibration import ece
from pipeline.study.intervals import bca
from pipeline.study.stats import (
    MARGINS,
    METRICS,
    Predictions,
    compare,
    paired_bootstrap,
    paired_difference,
    softmax,
)


def _overconfident(g, labels, scale):
    """Logits ~55 % accurate on 3 classes, overconfident by `scale`."""
    n = len(labels)
    logits = g.normal(size=(n, 3))
    logits[np.arange(n), labels] += 1.0
    return logits * scale


def _calibrated(g, n=10_000, classes=10, shift=0.0):
    """Top-label predictions whose correctness is drawn with probability confidence − shift:
    perfectly calibrated for shift 0, an l1 and l2 calibration error of exactly `shift` else."""
    logits = g.normal(size=(n, classes)) * 2.5
    p = softmax(logits)
    conf, pred = p.max(axis=1), p.argmax(axis=1)
    correct = g.random(n) < conf - shift
    labels = np.where(correct, pred, (pred + g.integers(1, classes, n)) % classes)
    return Predictions.from_logits(logits, labels)


def test_prediction_ece_is_the_evaluate_metric():
    g = np.random.default_rng(0)
    logits, labels = g.normal(size=(400, 5)) * 3, g.integers(0, 5, 400)
    p = Predictions.from_logits(logits, labels, 1.3)
    idx = g.integers(0, 400, 400)
    direct = ece(torch.from_numpy(logits[idx] / 1.3), torch.from_numpy(labels[idx]))
    assert p.ece(idx) == pytest.approx(direct, abs=1e-12)


def test_identical_runs_differ_by_exactly_zero_and_are_not_worse():
    g = np.random.default_rng(1)
    labels = g.integers(0, 3, 1000)
    logits = {s: _overconfident(g, labels, 4.0) for s in (0, 1, 2)}
    runs = {m: {s: Predictions.from_logits(z, labels) for s, z in logits.items()} for m in "ab"}
    for metric in METRICS:
        r = paired_difference(runs, "a", "b", 200, np.random.default_rng(0), metric)
        assert r["difference"] == 0 and r["relative"] == 0
        assert r["ci95_percentile"] == [0, 0] and r["ci95_bca"] == [0, 0] == r["ci95"]
        assert r["ci95_t"] == [0, 0] and r["verdict"] == "not worse"
        json.dumps(r)  # the study writes it to study.json as it is


def test_pairing_by_seed_removes_the_seed_effect():
    """Each seed moves ECE by up to 16 points; the method is the same logits 10 % cooler, 0.4 to
    2 points better on every seed. Paired by seed the interval is narrow and below 0; resampling
    each method's seeds on their own (the unpaired bootstrap) buries the shift in seed noise."""
    g = np.random.default_rng(3)
    labels = g.integers(0, 3, 2000)
    runs = {"ref": {}, "method": {}}
    for seed, scale in enumerate((2.0, 3.0, 5.0, 8.0, 12.0)):
        logits = _overconfident(g, labels, scale)
        runs["ref"][seed] = Predictions.from_logits(logits, labels)
        runs["method"][seed] = Predictions.from_logits(0.9 * logits, labels)
    per_seed = [100 * (runs["method"][s].ece() - runs["ref"][s].ece()) for s in range(5)]
    assert max(per_seed) < 0
    spread = np.ptp([100 * p.ece() for p in runs["ref"].values()])
    assert spread > 5 * abs(np.mean(per_seed))

    paired = paired_difference(runs, "method", "ref", 1000, np.random.default_rng(0))
    assert paired["difference"] == pytest.approx(np.mean(per_seed))
    for key in ("ci95_t", "ci95_percentile", "ci95_bca"):
        lo, hi = paired[key]
        assert lo < paired["difference"] < hi < 0 and hi - lo < 2.0
    assert paired["verdict"] == "better"

    # pairing by seed cancels the initialisation each seed shares: far narrower than the spread
    assert paired["ci95"][1] - paired["ci95"][0] < spread / 5


def test_debiased_ece_by_hand():
    """Five samples at confidence 0.9, one correct: mean gap −0.7, acc 0.2; a sixth alone in its
    bin adds nothing but counts in N: (5/6)·(0.49 − 0.2·0.8/4) = 0.375."""
    logits = np.array([[0.0, np.log(9.0)]] * 5 + [[0.0, np.log(1.5)]])
    p = Predictions.from_logits(logits, np.array([1, 0, 0, 0, 0, 1]))
    assert p.debiased_ece() == pytest.approx(np.sqrt(0.375))
    assert p.debiased_ece(np.arange(5)) == pytest.approx(np.sqrt(0.45))
    # one correct of five at 0.8: the variance term exceeds the squared gap, clipped to 0
    q = Predictions.from_logits(np.array([[0.0, np.log(4.0)]] * 5), np.array([1, 1, 1, 1, 0]))
    assert q.debiased_ece() == 0.0


def test_debiased_ece_removes_the_binned_ece_noise_floor():
    """Perfectly calibrated: the binned ECE is ~1 point of noise, the debiased estimate much
    closer to 0. Miscalibrated by 10 points in every bin: both find the 10."""
    for seed in range(5):
        p = _calibrated(np.random.default_rng(seed))
        assert 100 * p.ece() > 0.5
        assert p.debiased_ece() < 0.8 * p.ece()
    q = _calibrated(np.random.default_rng(0), shift=0.1)
    assert 100 * q.ece() == pytest.approx(10.0, abs=1.0)
    assert 100 * q.debiased_ece() == pytest.approx(10.0, abs=1.0)
    assert 100 * q.debiased_ece() == pytest.approx(100 * q.ece(), abs=0.3)


def test_runs_pair_on_shared_seeds_and_are_refused_without_any_or_other_test_images():
    g = np.random.default_rng(4)
    labels = g.integers(0, 3, 100)
    p = Predictions.from_logits(_overconfident(g, labels, 2.0), labels)
    runs = {"csm": {0: p, 1: p, 2: p}, "ce": {0: p, 1: p, 3: p, 4: p}}
    assert paired_difference(runs, "csm", "ce", 10, np.random.default_rng(0))["seeds"] == [0, 1]
    runs = {"csm": {2: p}, "ce": {0: p, 1: p}}
    with pytest.raises(ValueError, match=r"no seed in common \(csm: \[2\], ce: \[0, 1\]\)"):
        paired_difference(runs, "csm", "ce", 10, np.random.default_rng(0))
    other = Predictions.from_logits(p.logits, (labels + 1) % 3)
    runs = {"csm": {0: p, 1: p}, "ce": {0: p, 1: other}}
    with pytest.raises(ValueError, match="test labels differ"):
        paired_difference(runs, "csm", "ce", 10, np.random.default_rng(0))
    with pytest.raises(ValueError, match="brier"):
        paired_difference(runs, "csm", "ce", 10, np.random.default_rng(0), "brier")


def test_bca_equals_percentile_for_a_symmetric_unbiased_statistic():
    """NLL difference = the mean of symmetric per-image differences: no median bias (z0 ≈ 0),
    no skew (a ≈ 0), so BCa's interval is the percentile interval."""
    g = np.random.default_rng(5)
    labels = g.integers(0, 3, 5000)
    runs = {"ref": {}, "method": {}}
    for seed in range(3):
        p = Predictions.from_logits(g.normal(size=(5000, 3)), labels)
        runs["ref"][seed] = dataclasses.replace(p, nlls=g.normal(1.0, 0.3, 5000))
        shift = g.normal(0.01, 0.3, 5000)
        runs["method"][seed] = dataclasses.replace(p, nlls=runs["ref"][seed].nlls + shift)
    r = paired_difference(runs, "method", "ref", 4000, np.random.default_rng(0), "nll")
    assert abs(r["bca"]["z0"]) < 0.1 and abs(r["bca"]["acceleration"]) < 0.02
    half = (r["ci95_percentile"][1] - r["ci95_percentile"][0]) / 2
    assert r["ci95_bca"] == pytest.approx(r["ci95_percentile"], abs=0.1 * half)


def test_bca_moves_the_quantiles_as_its_formula_says():
    """For standard normal resamples the α-quantile is Φ⁻¹(α), so BCa's endpoints are
    z0 + (z0 + z)/(1 − a(z0 + z)) for z = ±1.96: with a = 0, the percentile interval shifted by
    2·z0."""
    thetas = np.random.default_rng(6).standard_normal(400_000)
    z = NormalDist().inv_cdf(0.975)
    assert bca(thetas, 0.0, 0.0) == pytest.approx([-z, z], abs=0.02)
    assert bca(thetas, 0.3, 0.0) == pytest.approx([0.6 - z, 0.6 + z], abs=0.02)
    expected = [0.1 + (0.1 + s) / (1 - 0.05 * (0.1 + s)) for s in (-z, z)]
    assert bca(thetas, 0.1, 0.05) == pytest.approx(expected, abs=0.02)


def test_any_pair_can_be_compared():
    """csm+maccal against ce+maccal, not only against ce; seeds given in any order."""
    g = np.random.default_rng(7)
    labels = g.integers(0, 3, 800)
    runs: dict[str, dict[int, Predictions]] = {}
    for method, scale in (("ce", 6.0), ("ce+maccal", 3.0), ("csm+maccal", 2.0)):
        runs[method] = {
            s: Predictions.from_logits(_overconfident(g, labels, scale), labels) for s in (2, 0, 1)
        }
    out = paired_bootstrap(runs, "ce+maccal", 200, np.random.default_rng(0), "nll", ["csm+maccal"])
    r = out["csm+maccal"]
    assert list(out) == ["csm+maccal"] and r["reference"] == "ce+maccal" and r["seeds"] == [0, 1, 2]
    direct = np.mean([runs["csm+maccal"][s].nll() - runs["ce+maccal"][s].nll() for s in range(3)])
    assert r["difference"] == pytest.approx(direct)
    assert r["margin"] == MARGINS["nll"]
    pairs = [("csm+maccal", "ce+maccal"), ("ce+maccal", "ce")]
    table = compare(runs, pairs, 100, lambda *key: np.random.default_rng(0), ["ece"])
    assert set(table["ece"]) == {"ce+maccal", "ce"}
    assert table["ece"]["ce"]["ce+maccal"]["verdict"] == "better"  # 3x vs 6x overconfident
    json.dumps(table)

    def keyed(*key: str) -> np.random.Generator:
        return np.random.default_rng(abs(hash(key)) % 2**32)

    alone = compare(runs, pairs[1:], 100, keyed, ["ece"])["ece"]["ce"]["ce+maccal"]
    # each comparison draws from its own generator: another pair first changes nothing
    assert compare(runs, pairs, 100, keyed, ["ece", "nll"])["ece"]["ce"]["ce+maccal"] == alone


def test_acceleration_of_a_mean_is_the_skewness_of_its_jackknife_values():
    """For NLL (a mean over images) the delete-a-block jackknife has d_g ∝ b_g − b̄ (b_g: the
    mean difference over block g's images, blocks i mod 100) and the delete-a-seed one d_k ∝
    s_k − s̄ (s_k: seed k's mean difference); each level's values scaled by (n − 1)/n,
    a = Σ e³ / (6 (Σ e²)^(3/2)) over both. Right-skewed per-image differences give a > 0."""
    g = np.random.default_rng(8)
    labels = g.integers(0, 3, 2000)
    p = Predictions.from_logits(g.normal(size=(2000, 3)), labels)
    diffs = g.exponential(size=(3, 2000)) ** 2
    runs = {
        "ref": {s: dataclasses.replace(p, nlls=np.zeros(2000)) for s in range(3)},
        "method": {s: dataclasses.replace(p, nlls=diffs[s]) for s in range(3)},
    }
    r = paired_difference(runs, "method", "ref", 100, np.random.default_rng(0), "nll")
    b = diffs.mean(axis=0).reshape(-1, 100).mean(axis=0)  # column g: images i with i % 100 = g
    s = diffs.mean(axis=1)
    e = np.concatenate([(b - b.mean()) / 100, (s - s.mean()) / 3])  # (n − 1)/n · d = (x − x̄)/n
    expected = (e**3).sum() / (6 * (e**2).sum() ** 1.5)
    assert expected > 0.005
    assert r["bca"]["acceleration"] == pytest.approx(expected, rel=1e-9)


def test_predictions_from_calibrated_probabilities_equal_those_from_their_logits():
    """The baseline ce + best post-hoc stores probabilities: their logs give the same metrics."""
    g = np.random.default_rng(3)
    logits, labels = g.normal(size=(300, 5)) * 2, g.integers(0, 5, 300)
    a = Predictions.from_logits(logits, labels)
    b = Predictions.from_probs(softmax(logits), labels)
    idx = g.integers(0, 300, 300)
    for metric in ("ece", "debiased_ece", "nll"):
        assert getattr(a, metric)(idx) == pytest.approx(getattr(b, metric)(idx), abs=1e-9)
