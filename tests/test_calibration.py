"""Metrics (docs/evaluate.md) on constructed cases with known answers, and against torchmetrics.
The checks against torch-uncertainty, relplot, netcal, the `calibration` package and sklearn are
the reference tier: tests/test_reference_metrics.py (make test-reference)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from models.calibration import (
    METRIC_KEYS,
    NLL_FLOOR,
    aece,
    brier,
    calibration_metrics,
    classwise_ece,
    classwise_l2_ce,
    ece,
    ensemble_logits,
    fit_temperature,
    l2_ce,
    mce,
    nll,
    nll_of_probs,
    oece,
    probability_metrics,
    reliability_bins,
    temperature_grid,
    temperature_on_edge,
    topk_accuracy,
    uece,
)
from models.ood import auroc, average_precision, fpr_at_tpr, ood_scores
from models.selective import augrc, aurc, risk_at_coverage, risk_curves
from models.smooth_ece import smooth_ece, smooth_ece_at, smooth_ece_bandwidth


def two_class(conf: float, n: int, n_correct: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n samples predicting class 0 with confidence `conf`; the first n_correct have label 0."""
    logits = torch.tensor([[math.log(conf / (1 - conf)), 0.0]], dtype=torch.float64).repeat(n, 1)
    labels = torch.tensor([0] * n_correct + [1] * (n - n_correct))
    return logits, labels


def random_case(seed: int, n: int = 2000, c: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, generator=g) * 3, torch.randint(0, c, (n,), generator=g)


def test_all_correct_and_certain_has_zero_error():
    labels = torch.arange(10) % 4
    logits = 200.0 * F.one_hot(labels, 4).double()
    for metric in (ece, aece, mce, oece, uece, classwise_ece):
        assert metric(logits, labels) == pytest.approx(0.0, abs=1e-12)
    assert topk_accuracy(logits, labels) == 1.0 and brier(logits, labels) < 1e-12


def test_constant_confidence_08_with_60pct_accuracy():
    logits, labels = two_class(0.8, 10, 6)
    assert ece(logits, labels) == pytest.approx(0.2)
    assert mce(logits, labels) == pytest.approx(0.2)
    assert aece(logits, labels) == pytest.approx(0.2)
    assert oece(logits, labels) == pytest.approx(0.2) and uece(logits, labels) == 0.0
    report = calibration_metrics(logits, labels)
    assert report["ece"] == pytest.approx(20.0) and report["top1"] == pytest.approx(60.0)


def test_two_bins_ece_mce_oece_uece():
    # bin of conf 0.9 with acc 0.5 (over by 0.4); bin of conf 0.6 with acc 0.7 (under by 0.1)
    la, ya = two_class(0.9, 20, 10)
    lb, yb = two_class(0.6, 20, 14)
    logits, labels = torch.cat([la, lb]), torch.cat([ya, yb])
    assert ece(logits, labels) == pytest.approx(0.5 * 0.4 + 0.5 * 0.1)
    assert mce(logits, labels) == pytest.approx(0.4)
    assert oece(logits, labels) == pytest.approx(0.2)
    assert uece(logits, labels) == pytest.approx(0.05)


def test_oece_plus_uece_is_ece():
    logits, labels = random_case(1)
    assert oece(logits, labels) + uece(logits, labels) == pytest.approx(ece(logits, labels))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ece_mce_agree_with_torchmetrics(seed):
    from torchmetrics.classification import MulticlassCalibrationError

    logits, labels = random_case(seed)
    probs = F.softmax(logits, 1)
    for norm, ours in (("l1", ece), ("max", mce)):
        ref = MulticlassCalibrationError(num_classes=10, n_bins=15, norm=norm)(probs, labels)
        assert ours(logits, labels) == pytest.approx(ref.item(), abs=1e-5), norm


def test_aece_matches_direct_equal_mass_binning():
    logits, labels = random_case(3, n=997)
    conf, pred = F.softmax(logits.double(), 1).max(1)
    correct = (pred == labels).double().numpy()
    conf_np = conf.numpy()
    s = np.sort(conf_np)
    edges = np.interp(np.linspace(0, len(s), 16), np.arange(len(s)), s)
    edges[0], edges[-1] = -np.inf, np.inf  # outer bins open: the minimum is kept
    expected = 0.0
    for lo, hi in itertools.pairwise(edges):
        m = (conf_np > lo) & (conf_np <= hi)
        if m.any():
            expected += m.mean() * abs(correct[m].mean() - conf_np[m].mean())
    assert aece(logits, labels) == pytest.approx(expected, abs=1e-12)


def test_classwise_ece_matches_per_class_loop():
    logits, labels = random_case(4, n=500, c=4)
    p = F.softmax(logits.double(), 1).numpy()
    y = labels.numpy()
    per_class = []
    for k in range(4):
        total = 0.0
        for m in range(15):
            lo, hi = m / 15, (m + 1) / 15
            inb = (p[:, k] > lo) & (p[:, k] <= hi) if m else p[:, k] <= hi
            if inb.any():
                total += inb.mean() * abs((y[inb] == k).mean() - p[inb, k].mean())
        per_class.append(total)
    assert classwise_ece(logits, labels) == pytest.approx(float(np.mean(per_class)), abs=1e-9)


def test_nll_brier_topk_hand_values():
    logits = torch.tensor([[0.0, math.log(3.0), -100.0], [2.0, 1.0, 0.0]])
    labels = torch.tensor([1, 2])
    p1 = F.softmax(logits[1].double(), 0)
    assert nll(logits, labels) == pytest.approx((-math.log(0.75) - math.log(p1[2].item())) / 2)
    b0 = 0.25**2 + 0.25**2  # p = (1/4, 3/4, ~0) against (0, 1, 0)
    b1 = p1[0].item() ** 2 + p1[1].item() ** 2 + (1 - p1[2].item()) ** 2
    assert brier(logits, labels) == pytest.approx((b0 + b1) / 2, rel=1e-6)
    assert topk_accuracy(logits, labels, 1) == 0.5
    assert topk_accuracy(logits, labels, 2) == 0.5
    assert topk_accuracy(logits, labels, 5) == 1.0  # k capped at C = 3


def test_calibration_metrics_scales_percentages():
    logits, labels = random_case(5, n=300)
    report = calibration_metrics(logits, labels)
    assert report["ece"] == pytest.approx(100 * ece(logits, labels))
    assert report["classwise_ece"] == pytest.approx(100 * classwise_ece(logits, labels))
    assert report["top5"] == pytest.approx(100 * topk_accuracy(logits, labels, 5))
    assert report["nll"] == pytest.approx(nll(logits, labels)) and report["n"] == 300
    with pytest.raises(ValueError, match="logits"):
        calibration_metrics(logits[:, 0], labels)


def test_reliability_bins_are_right_closed():
    edges = reliability_bins(torch.tensor([0.5]), torch.tensor([True]))["edges"]
    conf = torch.cat([edges[3].repeat(3), torch.tensor([0.95, 0.95], dtype=torch.float64)])
    correct = torch.tensor([1, 1, 0, 1, 0])
    bins = reliability_bins(conf, correct)
    assert bins["count"].tolist() == [0, 0, 3] + [0] * 11 + [2]  # edges[3] is in bin 3 = index 2
    assert bins["acc"][2].item() == pytest.approx(2 / 3) and bins["acc"][14].item() == 0.5
    assert bins["conf"][2].item() == pytest.approx(edges[3].item())
    assert torch.isnan(bins["acc"][0]) and torch.isnan(bins["conf"][5])


@pytest.mark.parametrize("t0", [0.5, 2.0])
def test_temperature_scaling_recovers_known_temperature(t0):
    # labels drawn from softmax(z / T0): the calibrated logits are z / T0, so T = T0
    g = torch.Generator().manual_seed(7)
    z = torch.randn(20000, 10, generator=g) * 3
    labels = torch.multinomial(F.softmax(z / t0, 1), 1, generator=g).squeeze(1)
    t = fit_temperature(z, labels)
    assert t in temperature_grid() and abs(t - t0) <= 0.15 * t0
    assert ece(z / t, labels) < ece(z, labels)


def test_ece_criterion_picks_the_grid_temperature_with_the_lowest_val_ece():
    """Against torchmetrics' ECE at every grid point: the argmin, the first (smallest T) on ties."""
    from torchmetrics.classification import MulticlassCalibrationError

    logits, labels = random_case(6, n=600, c=5)
    metric = MulticlassCalibrationError(num_classes=5, n_bins=15, norm="l1")
    scores = [metric(F.softmax(logits.double() / t, 1), labels).item() for t in temperature_grid()]
    t = fit_temperature(logits, labels, criterion="ece")
    best = min(scores)
    assert scores[temperature_grid().index(t)] == pytest.approx(best, abs=1e-6)
    assert all(s > best + 1e-6 for s in scores[: temperature_grid().index(t)])


def test_temperature_grid_and_bad_grid():
    grid = temperature_grid()
    assert len(grid) == 100 and grid[0] == 0.1 and grid[-1] == 10.0 and 1.0 in grid
    with pytest.raises(ValueError, match="grid"):
        fit_temperature(torch.zeros(2, 2), torch.tensor([0, 1]), grid=[0.0, 1.0])


def test_auroc_is_mann_whitney_with_ties():
    pos = torch.tensor([0.9, 0.8, 0.8, 0.3, 0.5])
    neg = torch.tensor([0.8, 0.1, 0.3, 0.7])
    u = sum((p > q) + 0.5 * (p == q) for p in pos.tolist() for q in neg.tolist())
    assert auroc(pos, neg) == pytest.approx(u / 20)
    assert auroc(torch.tensor([2.0, 3.0]), torch.tensor([0.0, 1.0])) == 1.0
    assert auroc(torch.tensor([0.0, 1.0]), torch.tensor([2.0, 3.0])) == 0.0
    assert auroc(torch.ones(7), torch.ones(4)) == 0.5
    same = torch.rand(50, generator=torch.Generator().manual_seed(0))
    assert auroc(same, same.clone()) == pytest.approx(0.5)


def test_fpr_at_95_tpr_hand_case():
    pos = torch.arange(1.0, 21.0)  # 20 positives; keeping 19 needs threshold 2
    neg = torch.tensor([0.5, 2.0, 2.5, 100.0])
    assert fpr_at_tpr(pos, neg) == pytest.approx(3 / 4)
    assert fpr_at_tpr(pos, torch.tensor([0.0, 1.9])) == 0.0


def test_ood_scores_separable_and_identical():
    id_logits = 10.0 * F.one_hot(torch.arange(40) % 5, 5).float()
    ood_logits = torch.randn(30, 5, generator=torch.Generator().manual_seed(0)) * 0.1
    scores = ood_scores(id_logits, ood_logits)
    names = ("msp", "entropy", "maxlogit", "energy")
    stats = ("auroc", "fpr95", "aupr_in", "aupr_out")
    assert list(scores) == [f"{n}_{s}" for n in names for s in stats]
    assert all(scores[f"{n}_{s}"] == v for n in names for s, v in zip(stats, (100, 0, 100, 100)))
    same = ood_scores(ood_logits, ood_logits.clone())
    assert all(same[f"{n}_auroc"] == pytest.approx(50.0) for n in names)
    # an ensemble's logits are log mean softmax: no max-logit or energy scores
    assert set(ood_scores(id_logits, ood_logits, logit_scores=False)) == {
        f"{n}_{s}" for n in ("msp", "entropy") for s in stats
    }


def test_energy_and_max_logit_scores_read_the_raw_logits():
    # two ID samples with large logits, two OOD samples with the same softmax, logits shifted
    # down: MSP cannot tell them apart, max-logit and energy (logsumexp) can
    base = torch.tensor([[3.0, 0.0, 0.0], [0.0, 2.0, 1.0]], dtype=torch.float64)
    scores = ood_scores(base + 5.0, base - 5.0)
    assert scores["msp_auroc"] == 50.0 and scores["entropy_auroc"] == 50.0
    assert scores["maxlogit_auroc"] == 100.0 and scores["energy_auroc"] == 100.0
    assert scores["energy_fpr95"] == 0.0 and scores["energy_aupr_out"] == 100.0


def test_average_precision_hand_cases():
    # ranking +, -, +, -: precision 1 at recall 1/2, 2/3 at recall 1 -> AP = (1 + 2/3) / 2
    pos, neg = torch.tensor([4.0, 2.0]), torch.tensor([3.0, 1.0])
    assert average_precision(pos, neg) == pytest.approx((1 + 2 / 3) / 2)
    # the other way round (AUPR-out): -1 (+), -2 (-), -3 (+), -4 (-): the same ranks
    assert average_precision(neg.neg(), pos.neg()) == pytest.approx((1 + 2 / 3) / 2)
    # -, +, +: precision 1/2 at recall 1/2, 2/3 at recall 1
    assert average_precision(torch.tensor([2.0, 1.0]), torch.tensor([3.0])) == pytest.approx(
        (1 / 2 + 2 / 3) / 2
    )
    # a tie is one threshold: {+, -} at 1.0 then + at 0.5 -> (1/2)(1/2) + (1/2)(2/3)
    pos, neg = torch.tensor([1.0, 0.5]), torch.tensor([1.0])
    assert average_precision(pos, neg) == pytest.approx(0.5 * 0.5 + 0.5 * 2 / 3)
    assert average_precision(torch.ones(3), torch.zeros(5)) == 1.0


def test_risk_coverage_hand_case():
    # most confident first: right, wrong, right, wrong -> E_k = 0, 1, 1, 2
    conf = torch.tensor([0.7, 0.9, 0.6, 0.8])
    correct = torch.tensor([1.0, 1.0, 0.0, 0.0])
    r, g = risk_curves(conf, correct)
    assert r.tolist() == pytest.approx([0, 1 / 2, 1 / 3, 1 / 2])
    assert g.tolist() == pytest.approx([0, 1 / 4, 1 / 4, 2 / 4])
    assert aurc(conf, correct) == pytest.approx((0 + 1 / 2 + 1 / 3 + 1 / 2) / 4)
    assert augrc(conf, correct) == pytest.approx(1 / 4)
    assert risk_at_coverage(conf, correct, 0.8) == pytest.approx(1 / 2)  # k = ceil(3.2) = 4
    assert risk_at_coverage(conf, correct, 0.5) == pytest.approx(1 / 2)  # k = 2
    assert risk_at_coverage(conf, correct, 0.25) == 0.0
    n = 10  # all wrong: r = 1, g = k/N, AUGRC = (N + 1)/(2N)
    assert aurc(torch.rand(n), torch.zeros(n)) == 1.0
    assert augrc(torch.rand(n), torch.zeros(n)) == pytest.approx((n + 1) / (2 * n))
    assert aurc(torch.rand(n), torch.ones(n)) == 0.0
    # a perfect ranking (every error least confident) has the lowest AURC of its accuracy
    ranked = aurc(torch.arange(8.0), torch.tensor([0.0, 0, 1, 1, 1, 1, 1, 1]))
    assert ranked < aurc(torch.arange(8.0), torch.tensor([1.0, 1, 1, 1, 1, 1, 0, 0]))
    with pytest.raises(ValueError, match="coverage"):
        risk_at_coverage(conf, correct, 0.0)


def test_smooth_ece_of_constant_confidence_and_of_calibrated_predictions():
    # every prediction 0.8 confident and right: the residual is -0.2 wherever there is mass
    n = 4000
    conf, correct = torch.full((n,), 0.8, dtype=torch.float64), torch.ones(n)
    assert smooth_ece(conf, correct) == pytest.approx(0.2, abs=1e-6)
    # its bandwidth is the fixed point σ* = smECE_σ*, to relplot's bisection step 2^-10
    sigma = smooth_ece_bandwidth(conf, correct)
    assert abs(sigma - smooth_ece_at(conf, correct, sigma)) <= 2**-10
    # hits drawn with probability c: calibrated, a small error (sampling noise only); drawn
    # with probability c - 0.1: overconfident by 0.1
    g = torch.Generator().manual_seed(0)
    c = 0.5 + 0.5 * torch.rand(n, generator=g, dtype=torch.float64)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    assert smooth_ece(c, (u < c).double()) < 0.025
    assert smooth_ece(c, (u < c - 0.1).double()) == pytest.approx(0.1, abs=0.02)


def test_l2_calibration_errors_two_bin_hand_case():
    # bin of conf 0.9 with acc 0.5 (20 samples), bin of conf 0.6 with acc 0.7 (20 samples)
    la, ya = two_class(0.9, 20, 10)
    lb, yb = two_class(0.6, 20, 14)
    logits, labels = torch.cat([la, lb]), torch.cat([ya, yb])
    assert l2_ce(logits, labels) == pytest.approx(math.sqrt(0.5 * 0.4**2 + 0.5 * 0.1**2))
    debiased = 0.5 * (0.4**2 - 0.25 / 19) + 0.5 * (0.1**2 - 0.21 / 19)
    assert l2_ce(logits, labels, debias=True) == pytest.approx(math.sqrt(debiased))
    # classwise: class 0 has p_0 = 0.9 (freq 0.5), 0.6 (freq 0.7); class 1 has p_1 = 0.1
    # (freq 0.5), 0.4 (freq 0.3): the same gaps, so the root mean square over classes is l2
    assert classwise_l2_ce(logits, labels) == pytest.approx(l2_ce(logits, labels))
    # the debiased error of a calibrated bin is ~0 where the plug-in one is not
    lc, yc = two_class(0.7, 10, 7)
    assert l2_ce(lc, yc) == pytest.approx(0.0, abs=1e-12)
    assert l2_ce(lc, yc, debias=True) == 0.0  # 0 - 0.21/9 < 0, clipped
    lone, y1 = two_class(0.9, 1, 0)  # one sample: no variance estimate, the bin adds 0
    assert l2_ce(lone, y1, debias=True) == 0.0 and l2_ce(lone, y1) == pytest.approx(0.9)


def test_probability_metrics_equal_calibration_metrics_of_the_softmax():
    logits, labels = random_case(6, n=400, c=6)
    from_logits = calibration_metrics(logits, labels)
    from_probs = probability_metrics(F.softmax(logits.double(), 1), labels)
    assert list(from_logits) == list(from_probs) == list(METRIC_KEYS)
    assert from_probs == pytest.approx(from_logits, rel=1e-9)
    only = calibration_metrics(logits, labels, keys=("nll", "ece", "top1"))
    assert list(only) == ["top1", "ece", "nll"] and only["ece"] == from_logits["ece"]
    assert from_logits["debiased_ece"] == pytest.approx(100 * l2_ce(logits, labels, debias=True))
    assert from_logits["classwise_l2_ece"] == pytest.approx(100 * classwise_l2_ce(logits, labels))
    with pytest.raises(ValueError, match="unknown metric"):
        probability_metrics(F.softmax(logits, 1), labels, keys=("ece", "ecce"))


def test_nll_of_probabilities_floors_a_zero_label_probability():
    p = torch.tensor([[1.0, 0.0], [0.25, 0.75]], dtype=torch.float64)
    labels = torch.tensor([1, 1])
    assert nll_of_probs(p, labels) == pytest.approx((-math.log(NLL_FLOOR) - math.log(0.75)) / 2)
    assert -math.log(NLL_FLOOR) == pytest.approx(36.04, abs=0.01)


def test_ensemble_logits_softmax_is_mean_softmax():
    g = torch.Generator().manual_seed(0)
    members = [torch.randn(6, 4, generator=g) * 2 for _ in range(3)]
    mean_p = torch.stack([F.softmax(m, 1) for m in members]).mean(0)
    out = ensemble_logits(members)
    assert torch.allclose(F.softmax(out, 1), mean_p, atol=1e-6)
    assert torch.allclose(out.exp().sum(1), torch.ones(6), atol=1e-5)  # log of a distribution
    assert torch.allclose(F.softmax(ensemble_logits(members[:1]), 1), F.softmax(members[0], 1))
    with pytest.raises(ValueError, match="same shape"):
        ensemble_logits([members[0], members[1][:3]])


def test_nll_temperature_equals_direct_minimisation():
    # overconfident logits: labels drawn from softmax(z / 2)
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2000, 10, generator=g, dtype=torch.float64) * 4
    labels = torch.multinomial(F.softmax(z / 2.0, 1), 1, generator=g).squeeze(1)
    t = fit_temperature(z, labels, criterion="nll")

    # an independent minimiser: a grid of T over the whole range, then a fine grid around its best
    def nll_grid(grid):
        return torch.stack([F.cross_entropy(z / s, labels) for s in grid])

    coarse = torch.linspace(0.05, 20.0, 400, dtype=torch.float64)
    best = float(coarse[nll_grid(coarse).argmin()])
    fine = torch.linspace(best - 0.06, best + 0.06, 600, dtype=torch.float64)
    nlls = nll_grid(fine)
    best = float(fine[nlls.argmin()])
    assert abs(t - best) <= 3e-4 and abs(t - 2.0) < 0.2
    nll_t = F.cross_entropy(z / t, labels).item()
    assert nll_t <= nlls.min().item() + 1e-9
    for dt in (-0.01, 0.01):  # a local (hence, by convexity in 1/T, global) minimum
        assert nll_t < F.cross_entropy(z / (t + dt), labels).item()
    assert not temperature_on_edge(t, "nll")


def test_nll_temperature_is_the_cross_entropy_golden_section():
    """fit_temperature_nll evaluates NLL(β) from class-major differences; the golden section
    of earlier versions on F.cross_entropy, kept here, lands on the same T to 1e-6 (near its
    minimum the NLL changes by float64's resolution over Δβ/β ~ 1e-8, so neither pins T
    closer)."""

    def old_fit(s: torch.Tensor, y: torch.Tensor) -> float:
        lo, hi = 1.0 / 20.0, 1.0 / 0.05
        ratio = (math.sqrt(5.0) - 1.0) / 2.0
        b1, b2 = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        f1, f2 = (float(F.cross_entropy(s * b, y)) for b in (b1, b2))
        for _ in range(80):
            if f1 <= f2:
                hi, b2, f2 = b2, b1, f1
                b1 = hi - ratio * (hi - lo)
                f1 = float(F.cross_entropy(s * b1, y))
            else:
                lo, b1, f1 = b1, b2, f2
                b2 = lo + ratio * (hi - lo)
                f2 = float(F.cross_entropy(s * b2, y))
        return 1.0 / ((lo + hi) / 2.0)

    g = torch.Generator().manual_seed(5)
    for scale, n, c in ((4.0, 1500, 10), (0.5, 300, 3), (30.0, 200, 100)):
        z = torch.randn(n, c, generator=g, dtype=torch.float64) * scale
        labels = torch.multinomial(F.softmax(z / 1.7, 1), 1, generator=g).squeeze(1)
        assert fit_temperature(z, labels, criterion="nll") == pytest.approx(
            old_fit(z, labels), rel=1e-6
        )


def test_temperature_edges_are_flagged():
    # a perfectly separable val set: NLL keeps falling as T -> 0, so the fit lands on the floor
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]] * 10, dtype=torch.float64)
    labels = torch.tensor([0, 1] * 10)
    t = fit_temperature(z, labels, criterion="nll")
    assert t == pytest.approx(0.05, rel=1e-6) and temperature_on_edge(t, "nll")
    assert temperature_on_edge(10.0, "ece") and temperature_on_edge(0.1, "ece")
    assert not temperature_on_edge(1.3, "ece")
    with pytest.raises(ValueError, match="criterion"):
        fit_temperature(z, labels, criterion="brier")


def test_the_study_numpy_debiased_ece_is_the_same_estimator():
    """pipeline/study/stats.py keeps a numpy copy (for its bootstraps) of the debiased l2 error:
    the same number, so one of the two can go."""
    from pipeline.study.stats import Predictions

    logits, labels = random_case(7, n=1500)
    study = Predictions.from_logits(logits.double().numpy(), labels.numpy(), 1.7)
    assert study.debiased_ece() == pytest.approx(
        l2_ce(logits.double() / 1.7, labels, debias=True), abs=1e-12
    )
