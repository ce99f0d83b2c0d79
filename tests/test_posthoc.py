"""Post-hoc calibrators (models/posthoc.py) on constructed cases: hand-computed fits, what each
model nests, determinism, the stratified folds and the choice by cross-validated val NLL. The
checks against netcal, torch-uncertainty and sklearn are in tests/test_reference_metrics.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from models.calibration import nll_of_probs
from models.posthoc import (
    CV_FOLDS,
    POSTHOC,
    DirichletScaling,
    HistogramBinning,
    IsotonicRegression,
    Temperature,
    VectorScaling,
    cross_validated_nll,
    cv_folds,
    fit_posthoc,
    isotonic_fit,
    isotonic_predict,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def tempered(seed: int, n: int = 600, c: int = 4, t: float = 2.0, bias: torch.Tensor | None = None):
    """Logits s whose labels are drawn from softmax(s / t + bias): TS with T = t (and no bias)
    is the true calibration map."""
    g = torch.Generator().manual_seed(seed)
    s = 3.0 * torch.randn(n, c, generator=g, dtype=torch.float64)
    z = s / t + (bias if bias is not None else 0.0)
    y = torch.multinomial(F.softmax(z, 1), 1, generator=g).squeeze(1)
    return s, y


def objective_vector(cal: VectorScaling, s: torch.Tensor, y: torch.Tensor) -> float:
    return float(F.cross_entropy(F.log_softmax(s, 1) * cal.w + cal.b, y))


def test_registry_and_every_output_is_a_distribution():
    assert list(POSTHOC) == ["temperature", "vector", "dirichlet", "histogram", "isotonic"]
    s, y = tempered(0)
    test, _ = tempered(1, n=50)
    for name, cls in POSTHOC.items():
        p = cls().fit(s, y).probs(test)
        assert p.dtype == torch.float64 and p.shape == (50, 4), name
        assert (p >= 0).all() and torch.allclose(p.sum(1), torch.ones(50, dtype=torch.float64))


def test_fits_are_deterministic():
    s, y = tempered(2)
    for name, cls in POSTHOC.items():
        a, b = cls().fit(s, y).probs(s), cls().fit(s.clone(), y.clone()).probs(s)
        assert torch.equal(a, b), name


def test_temperature_recovers_the_true_temperature_and_ignores_the_logit_offset():
    s, y = tempered(3, n=4000, t=2.0)
    cal = Temperature().fit(s, y)
    assert cal.t == pytest.approx(2.0, rel=0.1)
    shifted = s + torch.arange(4000, dtype=torch.float64)[:, None]  # per-sample offsets
    assert torch.allclose(cal.probs(shifted), F.softmax(s / cal.t, 1))


def test_vector_scaling_finds_a_class_bias_that_temperature_cannot():
    bias = torch.tensor([1.0, 0.0, -1.0, 0.0], dtype=torch.float64)
    s, y = tempered(4, n=3000, t=1.0, bias=bias)
    vec = VectorScaling().fit(s, y)
    assert vec.w == pytest.approx(torch.ones(4, dtype=torch.float64), abs=0.15)
    assert (vec.b - vec.b.mean()) == pytest.approx(bias - bias.mean(), abs=0.15)
    # vector scaling nests temperature (w = 1/T, b = 0): its in-sample NLL is no higher
    t = Temperature().fit(s, y)
    assert objective_vector(vec, s, y) <= nll_of_probs(t.probs(s), y) + 1e-9


def test_dirichlet_nests_vector_scaling_under_its_own_objective():
    s, y = tempered(5, n=800, bias=torch.tensor([0.5, 0.0, 0.0, -0.5], dtype=torch.float64))
    vec, d = VectorScaling().fit(s, y), DirichletScaling().fit(s, y)
    x, c = F.log_softmax(s, 1), 4

    def objective(weight: torch.Tensor, bias: torch.Tensor) -> float:
        off = weight * (1 - torch.eye(c, dtype=torch.float64))
        penalty = d.lam * off.pow(2).sum() / (c * (c - 1)) + d.mu * bias.pow(2).mean()
        return float(F.cross_entropy(x @ weight.T + bias, y) + penalty)

    b = vec.b - vec.b.mean()  # the same probabilities, the smallest intercept penalty
    assert objective(d.weight, d.bias) <= objective(torch.diag(vec.w), b) + 1e-9
    # the penalty keeps the off-diagonal small; no penalty at all gives a larger one
    free = DirichletScaling(lam=0.0, mu=0.0).fit(s, y)
    off = 1 - torch.eye(c, dtype=torch.float64)
    assert (d.weight * off).abs().sum() < (free.weight * off).abs().sum()


def test_histogram_binning_hand_case():
    # two classes, p_0 in three bins: 0.95 (labels 0, 0, 1), 0.5 (0, 1), 0.25 (1)
    p0 = torch.tensor([0.95, 0.95, 0.95, 0.5, 0.5, 0.25], dtype=torch.float64)
    logits = torch.stack([p0.log(), (1 - p0).log()], dim=1)
    labels = torch.tensor([0, 0, 1, 0, 1, 1])
    cal = HistogramBinning().fit(logits, labels)
    values = cal.values
    assert values[0, 14] == pytest.approx(2 / 3)  # p_0 = 0.95 in (14/15, 1]
    assert values[0, 7] == pytest.approx(1 / 2)  # p_0 = 0.5 in (7/15, 8/15]
    assert values[0, 3] == 0.0  # p_0 = 0.25 in (3/15, 4/15]
    assert values[1, 0] == pytest.approx(1 / 3)  # p_1 = 0.05 in (0, 1/15]
    assert values[0, 10] == pytest.approx(10.5 / 15)  # an empty bin: its centre
    p = cal.probs(logits)
    q0, q1 = 2 / 3, 1 / 3  # the first sample: one-vs-rest values, renormalised
    assert p[0].tolist() == pytest.approx([q0 / (q0 + q1), q1 / (q0 + q1)])
    assert p[5].tolist() == pytest.approx([0.0, 1.0])  # values[0, 3] = 0, values[1, 11] = 1


def test_histogram_binning_row_of_zeros_becomes_uniform():
    logits = torch.tensor([[0.0, 0.0]], dtype=torch.float64).repeat(4, 1)  # p = (1/2, 1/2)
    cal = HistogramBinning().fit(logits, torch.tensor([0, 1, 0, 1]))
    cal.values.zero_()  # every class's frequency 0 in every bin
    assert cal.probs(logits[:1]).tolist() == [[0.5, 0.5]]


def test_isotonic_pool_adjacent_violators_hand_case():
    x = torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64)
    y = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64)  # sorted by x: 1, 0, 1, 1
    knots, values = isotonic_fit(x, y)
    assert knots.tolist() == [0.1, 0.2, 0.3, 0.4]
    assert values.tolist() == [0.5, 0.5, 1.0, 1.0]  # the violation 1, 0 pooled to 0.5
    at = torch.tensor([0.0, 0.15, 0.25, 0.35, 0.9], dtype=torch.float64)
    assert isotonic_predict(knots, values, at).tolist() == pytest.approx(
        [0.5, 0.5, 0.75, 1.0, 1.0]  # linear between knots, constant beyond them
    )
    # inputs closer than 1e-15 are one knot (the smaller x), their targets averaged
    near = torch.tensor([0.5, 0.5 + 1e-16, 0.7], dtype=torch.float64)
    knots, values = isotonic_fit(near, torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64))
    assert knots.tolist() == [0.5, 0.7] and values.tolist() == [0.5, 1.0]
    one = isotonic_fit(torch.tensor([0.3, 0.3]).double(), torch.tensor([0.0, 1.0]).double())
    assert isotonic_predict(*one, torch.tensor([0.1, 0.9])).tolist() == [0.5, 0.5]


def test_isotonic_regression_is_monotone_per_class():
    s, y = tempered(6)
    cal = IsotonicRegression().fit(s, y)
    for knots, values in cal.fits:
        assert (values[1:] >= values[:-1]).all() and (knots[1:] > knots[:-1]).all()


def test_folds_are_stratified_and_deterministic():
    y = torch.tensor([2, 0, 0, 1, 0, 2, 0, 0, 1, 0, 0, 0])
    fold = cv_folds(y, 3)
    assert fold.tolist() == [0, 0, 1, 0, 2, 1, 0, 1, 1, 2, 0, 1]
    for k in range(3):  # class 0 (8 samples) splits 3/3/2 over the folds
        assert int(((fold == k) & (y == 0)).sum()) in (2, 3)
    assert torch.equal(cv_folds(y, 3), fold)


def test_cross_validated_nll_scores_each_sample_out_of_fold():
    s, y = tempered(7, n=200)
    fold = cv_folds(y, CV_FOLDS)
    total = 0.0
    for k in range(CV_FOLDS):
        held = fold == k
        p = Temperature().fit(s[~held], y[~held]).probs(s[held])
        total += -p.gather(1, y[held][:, None]).log().sum().item()
    assert cross_validated_nll("temperature", s, y) == pytest.approx(total / 200)


def test_fit_posthoc_picks_the_lowest_cross_validated_nll():
    bias = torch.tensor([1.5, 0.0, -1.5, 0.0], dtype=torch.float64)
    s, y = tempered(8, n=1000, t=2.0, bias=bias)
    fit = fit_posthoc(s, y)
    assert list(fit.val_nll) == list(POSTHOC) == list(fit.calibrators)
    assert fit.best == min(fit.val_nll, key=fit.val_nll.__getitem__)
    assert fit.val_nll["vector"] < fit.val_nll["temperature"]  # a class bias to learn
    assert all(math.isfinite(v) for v in fit.val_nll.values())
    probs = fit.probs(s[:5])
    assert list(probs) == list(POSTHOC)
    assert torch.equal(probs["vector"], fit.calibrators["vector"].probs(s[:5]))
    with pytest.raises(ValueError, match="val samples"):
        fit_posthoc(s[:9], y[:9])


def test_fit_posthoc_ties_go_to_the_first_registry_entry(monkeypatch):
    import models.posthoc

    monkeypatch.setattr(models.posthoc, "cross_validated_nll", lambda *args: 1.0)
    s, y = tempered(9, n=100)
    assert fit_posthoc(s, y).best == "temperature"
