"""Post-hoc calibrators (models/posthoc.py) on constructed cases: hand-computed fits, what each
model nests, determinism, the stratified folds and the choice by cross-validated val NLL. The
checks against netcal, torch-uncertainty and sklearn are in tests/test_reference_metrics.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from models import lbfgs
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


# ---------------------------------------------------------------- the fast fits against the old
# models/posthoc.py at 7b450c4 fitted vector and dirichlet scaling with torch.optim.LBFGS on an
# autograd objective and isotonic regression by a pool-adjacent-violators loop over every knot;
# those are kept here, as they were, as the slow references the fast fits must reproduce.


def torch_lbfgs(params: list[torch.Tensor], objective, max_iter: int = 300) -> int:
    """The old fit: torch.optim.LBFGS, strong Wolfe, the calibrators' settings; evaluations."""
    opt = torch.optim.LBFGS(
        params,
        lr=1.0,
        max_iter=max_iter,
        tolerance_grad=1e-7,
        tolerance_change=1e-12,
        history_size=20,
        line_search_fn="strong_wolfe",
    )
    evals = []

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = objective()
        loss.backward()
        evals.append(1)
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return len(evals)


def old_vector(s: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = F.log_softmax(s, 1)
    w = torch.ones(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    torch_lbfgs([w, b], lambda: F.cross_entropy(x * w + b, y))
    return w.detach(), b.detach()


def old_dirichlet(s: torch.Tensor, y: torch.Tensor, lam: float = 0.1, mu: float = 0.1):
    x = F.log_softmax(s, 1)
    c = x.shape[1]
    off = 1.0 - torch.eye(c, dtype=torch.float64)
    weight = torch.eye(c, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(c, dtype=torch.float64, requires_grad=True)

    def objective() -> torch.Tensor:
        penalty = lam * ((weight * off) ** 2).sum() / (c * (c - 1))
        return F.cross_entropy(x @ weight.T + bias, y) + penalty + mu * (bias**2).mean()

    torch_lbfgs([weight, bias], objective)
    return weight.detach(), bias.detach()


def old_isotonic_fit(x: torch.Tensor, y: torch.Tensor):
    """7b450c4's isotonic_fit: TIE pooling and PAV, one knot at a time."""
    order = torch.argsort(x, stable=True)
    xs, ys = x[order].tolist(), y[order].tolist()
    knots, sums, weights = [xs[0]], [0.0], [0.0]
    for xi, yi in zip(xs, ys):
        if xi - knots[-1] >= 1e-15:
            knots.append(xi)
            sums.append(0.0)
            weights.append(0.0)
        sums[-1] += yi
        weights[-1] += 1.0
    means, sizes, counts = [], [], []
    for s, w in zip(sums, weights):
        means.append(s / w)
        sizes.append(w)
        counts.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            m, w2, k = means.pop(), sizes.pop(), counts.pop()
            total = sizes[-1] + w2
            means[-1] = (means[-1] * sizes[-1] + m * w2) / total
            sizes[-1], counts[-1] = total, counts[-1] + k
    values = torch.repeat_interleave(torch.tensor(means, dtype=torch.float64), torch.tensor(counts))
    return torch.tensor(knots, dtype=torch.float64), values


def rosenbrock_paths(start: list[float]) -> tuple[np.ndarray, int, np.ndarray, int]:
    """(point, evaluations) of models/lbfgs.py and of torch.optim.LBFGS on Rosenbrock's valley."""
    calls: list[int] = []

    def rosen_np(v: np.ndarray):
        f = float(np.sum(100 * (v[1:] - v[:-1] ** 2) ** 2 + (1 - v[:-1]) ** 2))
        g = np.zeros_like(v)
        g[:-1] += -400 * v[:-1] * (v[1:] - v[:-1] ** 2) - 2 * (1 - v[:-1])
        g[1:] += 200 * (v[1:] - v[:-1] ** 2)
        calls.append(1)
        return f, g

    ours = lbfgs.minimise(rosen_np, np.array(start), max_iter=60)
    v = torch.tensor(start, dtype=torch.float64, requires_grad=True)
    loss = lambda: (100 * (v[1:] - v[:-1] ** 2) ** 2 + (1 - v[:-1]) ** 2).sum()  # noqa: E731
    evals = torch_lbfgs([v], loss, max_iter=60)
    return ours, len(calls), v.detach().numpy(), evals


def test_lbfgs_takes_torch_optim_lbfgs_steps():
    """models/lbfgs.py is torch.optim.LBFGS's algorithm: on Rosenbrock's valley (a hard path:
    bracketing, zoom and history updates all used) it takes the same number of objective
    evaluations to the same point, from two starts."""
    for start in ([-1.5, 2.0, -0.5, 1.2], [0.3, -0.8, 1.9, 0.0]):
        ours, ours_evals, theirs, their_evals = rosenbrock_paths(start)
        assert ours_evals == their_evals > 20
        assert np.abs(ours - theirs).max() < 1e-8


def dirichlet_objective(s, y, weight, bias, lam: float = 0.1, mu: float = 0.1) -> float:
    x, c = F.log_softmax(s, 1), s.shape[1]
    off = weight * (1 - torch.eye(c, dtype=torch.float64))
    penalty = lam * off.pow(2).sum() / (c * (c - 1)) + mu * bias.pow(2).mean()
    return float(F.cross_entropy(x @ weight.T + bias, y) + penalty)


@pytest.mark.parametrize(("n", "c", "seed"), [(1000, 10, 1), (600, 4, 2)])
def test_vector_and_dirichlet_match_the_torch_lbfgs_fits(n, c, seed):
    """Converged fits: the closed-form gradients and the numpy L-BFGS give the old fits'
    probabilities to 1e-4 (in fact ~1e-9) on val and on other logits."""
    s, y = tempered(seed, n=n, c=c, t=0.7)
    test, _ = tempered(seed + 100, n=300, c=c, t=0.7)
    w, b = old_vector(s, y)
    weight, bias = old_dirichlet(s, y)
    vec, d = VectorScaling().fit(s, y), DirichletScaling().fit(s, y)
    for logits in (s, test):
        x = F.log_softmax(logits, 1)
        assert (vec.probs(logits) - F.softmax(x * w + b, 1)).abs().max() < 1e-4
        assert (d.probs(logits) - F.softmax(x @ weight.T + bias, 1)).abs().max() < 1e-4


def test_a_capped_dirichlet_fit_matches_the_old_objective_not_its_point():
    """143 val samples and C = 10 (digits' val): dirichlet's 110 parameters reach the cap of
    evaluations before converging, in the old fit and the new. Where such a fit stops depends
    on rounding: the old code itself, given logits changed by a relative 1e-15, moves its
    probabilities by more than 1e-3. What holds is the objective reached, to 1e-5."""
    s, y = tempered(0, n=143, c=10, t=0.7)
    weight, bias = old_dirichlet(s, y)
    moved = old_dirichlet(s * (1 + 1e-15), y)
    d = DirichletScaling().fit(s, y)
    x = F.log_softmax(s, 1)
    p_old = F.softmax(x @ weight.T + bias, 1)
    assert (F.softmax(x @ moved[0].T + moved[1], 1) - p_old).abs().max() > 1e-3
    ours, old = dirichlet_objective(s, y, d.weight, d.bias), dirichlet_objective(s, y, weight, bias)
    assert ours == pytest.approx(old, abs=1e-5)


def test_vectorised_isotonic_matches_the_knot_by_knot_loop():
    """Random inputs with repeats, runs of ulp-close values spanning more than TIE (the walked
    case) and 0/1 or real targets: the same knots, values to 1e-12."""
    g = torch.Generator().manual_seed(11)
    for trial in range(80):
        n = int(torch.randint(1, 200, (1,), generator=g))
        kind = trial % 4
        if kind == 0:
            x = torch.rand(n, generator=g, dtype=torch.float64)
        elif kind == 1:  # heavy repeats
            x = torch.randint(0, 5, (n,), generator=g).double() / 4
        elif kind == 2:  # ulp steps below 1: chains of gaps < TIE spanning > TIE
            x = 1 - torch.randint(0, 30, (n,), generator=g).double() * 2.0**-53
        else:
            x = 0.5 + torch.randint(0, 40, (n,), generator=g).double() * 1e-16
        u = torch.rand(n, generator=g, dtype=torch.float64)
        y = (u < x.clamp(0, 1)).double() if trial % 2 else u
        knots, values = isotonic_fit(x, y)
        ref_knots, ref_values = old_isotonic_fit(x, y)
        assert torch.equal(knots, ref_knots), trial
        assert (values - ref_values).abs().max() < 1e-12, trial


def test_fit_posthoc_matches_the_old_calibrators():
    """Every calibrator of a 10-class fit with its cross-validated NLL: the old path (fold by
    fold, torch LBFGS, the knot loop) against fit_posthoc, probabilities to 1e-4."""
    s, y = tempered(12, n=400, c=10, t=0.6)
    test, _ = tempered(13, n=200, c=10, t=0.6)
    fit = fit_posthoc(s, y)
    fold = cv_folds(y)
    for name in ("vector", "dirichlet"):
        old = old_vector if name == "vector" else old_dirichlet
        p_y = torch.empty(y.numel(), dtype=torch.float64)
        for k in range(CV_FOLDS):
            held = fold == k
            a, b = old(s[~held], y[~held])
            x = F.log_softmax(s[held], 1)
            z = x * a + b if name == "vector" else x @ a.T + b
            p_y[held] = F.softmax(z, 1).gather(1, y[held][:, None]).squeeze(1)
        assert fit.val_nll[name] == pytest.approx(float(-p_y.log().mean()), abs=1e-4)
        a, b = old(s, y)
        x = F.log_softmax(test, 1)
        z = x * a + b if name == "vector" else x @ a.T + b
        assert (fit.probs(test)[name] - F.softmax(z, 1)).abs().max() < 1e-4
    p = F.softmax(s, 1)
    fits = [old_isotonic_fit(p[:, k], (y == k).double()) for k in range(10)]
    q = torch.stack([isotonic_predict(*f, F.softmax(test, 1)[:, k]) for k, f in enumerate(fits)], 1)
    ref = q / q.sum(1, keepdim=True)
    assert (fit.probs(test)["isotonic"] - ref).abs().max() < 1e-12


def _old_cross_entropy(z: np.ndarray, hit: np.ndarray) -> tuple[float, np.ndarray]:
    """posthoc._cross_entropy before it worked in place (kept as the reference)."""
    n = z.shape[1]
    m = z.max(axis=0)
    e = np.exp(z - m)
    total = e.sum(axis=0)
    loss = float(np.mean(m + np.log(total)) - np.mean(z.ravel()[hit]))
    e /= total
    e.ravel()[hit] -= 1.0
    return loss, e / n


@pytest.mark.parametrize("c, n", [(10, 4800), (3, 7), (100, 50)])
def test_cross_entropy_in_place_gives_the_old_numbers_bit_for_bit(c, n):
    from models.posthoc import _cross_entropy, _hits

    rng = np.random.default_rng(c)
    z = 5.0 * rng.standard_normal((c, n))
    y = rng.integers(0, c, n)
    want_loss, want_grad = _old_cross_entropy(z.copy(), _hits(y))
    loss, grad = _cross_entropy(z.copy(), _hits(y))
    assert loss == want_loss and np.array_equal(grad, want_grad)
    # and both are F.cross_entropy and its gradient
    zt = torch.from_numpy(z.T.copy()).requires_grad_()
    ref = F.cross_entropy(zt, torch.from_numpy(y))
    ref.backward()
    assert loss == pytest.approx(ref.detach().item(), abs=1e-12)
    np.testing.assert_allclose(grad, zt.grad.numpy().T, atol=1e-15)
