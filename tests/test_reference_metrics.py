"""Reference tier (`make test-reference`): every metric and post-hoc calibrator of
docs/evaluate.md against an implementation nobody here wrote, one package per item:

    AURC, AUGRC, risk at 80 %        torch-uncertainty (metrics.AURC, AUGRC, RiskAt80Cov)
    smooth ECE                       relplot (smECE, smECE_sigma)
    l2 / debiased / classwise l2     uncertainty-calibration (`calibration`, Kumar et al.)
    AUROC, AUPR-in/out, energy       scikit-learn (roc_auc_score, average_precision_score),
                                     scipy (logsumexp, softmax)
    NLL of probabilities             scikit-learn (log_loss)
    temperature, vector scaling      netcal (TemperatureScaling, LogisticCalibration)
    dirichlet (ODIR)                 torch-uncertainty (DirichletScaler)
    histogram binning                torch-uncertainty (HistogramBinningScaler)
    isotonic regression              scikit-learn (IsotonicRegression, one-vs-rest)

Closed forms agree to 1e-6 or better (most to rounding). The fitted calibrators minimise the
same convex objective as their reference, whose optimiser stops earlier than ours (netcal:
scipy's L-BFGS-B on numeric gradients; torch-uncertainty: L-BFGS without line search): there the
test asserts that our objective is no higher than the reference's (1e-9 slack) and that the
probabilities agree to the references' optimisation tolerance (1e-4). Each test skips
(pytest.importorskip) where its package is not installed: the default tier installs none of
them; `make test-reference` installs requirements-reference.txt with requirements.txt as
constraints.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from models.calibration import (
    calibration_metrics,
    classwise_l2_ce,
    l2_ce,
    nll_of_probs,
    probability_metrics,
)
from models.ood import ood_scores
from models.posthoc import (
    ODIR_LAMBDA,
    ODIR_MU,
    DirichletScaling,
    HistogramBinning,
    IsotonicRegression,
    Temperature,
    VectorScaling,
)
from models.selective import augrc, aurc, risk_at_coverage, risk_curves
from models.smooth_ece import smooth_ece, smooth_ece_at

pytestmark = pytest.mark.usefixtures("one_thread")


def case(seed: int, n: int = 2000, c: int = 10, scale: float = 1.5):
    """Logits that are right more often than chance and overconfident, float64, and labels."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, c, (n,), generator=g)
    s = (torch.randn(n, c, generator=g, dtype=torch.float64) * 2 + 3.0 * F.one_hot(y, c)) * scale
    return s, y


def conf_correct(logits: torch.Tensor, labels: torch.Tensor):
    c, pred = F.softmax(logits, 1).max(1)
    return c, (pred == labels).double()


@pytest.fixture(scope="module")
def quiet():
    """The references log and warn while fitting (model=None, tqdm, pyro)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        yield
        logging.disable(logging.NOTSET)


# ---------------------------------------------------------------- metrics


@pytest.mark.parametrize("seed", [0, 1])
def test_risk_coverage_matches_torch_uncertainty(seed):
    tu = pytest.importorskip("torch_uncertainty.metrics")
    logits, labels = case(seed, n=1500 + seed)
    probs = F.softmax(logits, 1)
    conf, correct = conf_correct(logits, labels)
    r, g = risk_curves(conf, correct)
    n = len(labels)

    def reference(metric) -> float:
        metric.update(probs, labels)
        return float(metric.compute())

    # torch-uncertainty integrates the same points by trapezoid and divides by (1 - 1/N)
    def trapezoid(curve: torch.Tensor) -> float:
        return float((curve.sum() - (curve[0] + curve[-1]) / 2) / (n - 1))

    assert trapezoid(r) == pytest.approx(reference(tu.AURC()), abs=1e-6)
    assert trapezoid(g) == pytest.approx(reference(tu.AUGRC()), abs=1e-6)
    assert aurc(conf, correct) == pytest.approx(float(r.mean()), abs=1e-15)
    assert augrc(conf, correct) == pytest.approx(float(g.mean()), abs=1e-15)
    # and the two definitions differ by O(1/N)
    assert abs(aurc(conf, correct) - reference(tu.AURC())) < 2 / n
    assert risk_at_coverage(conf, correct, 0.8) == pytest.approx(
        reference(tu.RiskAt80Cov()), abs=1e-6
    )


@pytest.mark.parametrize(("seed", "n", "scale"), [(0, 2000, 1.5), (1, 300, 3.0), (2, 5000, 0.6)])
def test_smooth_ece_matches_relplot(seed, n, scale):
    relplot = pytest.importorskip("relplot")
    logits, labels = case(seed, n=n, scale=scale)
    conf, correct = conf_correct(logits, labels)
    f, y = conf.numpy(), correct.numpy()
    assert smooth_ece(conf, correct) == pytest.approx(relplot.smECE(f, y), abs=1e-9)
    for sigma in (0.3, 0.05, 0.004):  # 0.004: a grid of 2500 points
        ref = relplot.smECE_sigma(f, y, sigma)
        assert smooth_ece_at(conf, correct, sigma) == pytest.approx(ref, abs=1e-9)
    # calibrated by construction: labels drawn from the confidences, a small smECE
    g = np.random.default_rng(seed)
    f = g.uniform(0.3, 1.0, n)
    y = (g.uniform(size=n) < f).astype(float)
    ours = smooth_ece(torch.from_numpy(f), torch.from_numpy(y))
    assert ours == pytest.approx(relplot.smECE(f, y), abs=1e-9)


@pytest.mark.parametrize("seed", [0, 1])
def test_l2_calibration_errors_match_kumar_package(seed):
    kumar = pytest.importorskip("calibration")  # pip: uncertainty-calibration
    logits, labels = case(seed, n=3000)
    p, y = F.softmax(logits, 1).numpy(), labels.numpy()

    def reference(mode: str, debias: bool) -> float:
        return kumar.lower_bound_scaling_ce(
            *(p, y),
            p=2,
            debias=debias,
            num_bins=15,
            binning_scheme=kumar.get_equal_prob_bins,  # 15 equal-width bins, as ECE's
            mode=mode,
        )

    for debias in (False, True):
        assert l2_ce(logits, labels, debias=debias) == pytest.approx(
            reference("top-label", debias), abs=1e-12
        )
        assert classwise_l2_ce(logits, labels, debias=debias) == pytest.approx(
            reference("marginal", debias), abs=1e-12
        )
    report = calibration_metrics(logits, labels)
    assert report["debiased_ece"] == pytest.approx(100 * reference("top-label", True), abs=1e-9)
    assert report["l2_ece"] == pytest.approx(100 * reference("top-label", False), abs=1e-9)
    assert report["classwise_l2_ece"] == pytest.approx(100 * reference("marginal", False), abs=1e-9)


def test_ood_scores_match_sklearn_and_scipy():
    metrics = pytest.importorskip("sklearn.metrics")
    special = pytest.importorskip("scipy.special")
    id_logits, _ = case(0, n=800)
    ood_logits, _ = case(1, n=500, scale=0.4)
    ood_logits[:50] = id_logits[:50]  # some ties between the two sets

    def scores(s: np.ndarray) -> dict[str, np.ndarray]:
        p = special.softmax(s, axis=1)
        return {
            "msp": p.max(1),
            "entropy": (p * np.log(np.clip(p, 1e-300, None))).sum(1),
            "maxlogit": s.max(1),
            "energy": special.logsumexp(s, axis=1),
        }

    ours = ood_scores(id_logits, ood_logits)
    a, b = scores(id_logits.numpy()), scores(ood_logits.numpy())
    for name in a:
        hit = np.r_[np.ones(len(a[name])), np.zeros(len(b[name]))]
        score = np.r_[a[name], b[name]]
        assert ours[f"{name}_auroc"] == pytest.approx(
            100 * metrics.roc_auc_score(hit, score), abs=1e-9
        )
        assert ours[f"{name}_aupr_in"] == pytest.approx(
            100 * metrics.average_precision_score(hit, score), abs=1e-9
        )
        assert ours[f"{name}_aupr_out"] == pytest.approx(
            100 * metrics.average_precision_score(1 - hit, -score), abs=1e-9
        )


def test_nll_of_probabilities_matches_sklearn_log_loss():
    metrics = pytest.importorskip("sklearn.metrics")
    logits, labels = case(3, n=500, c=5)
    p = F.softmax(logits, 1)
    p[:20] = F.one_hot((labels[:20] + 1) % 5, 5).double()  # label probability exactly 0
    ref = metrics.log_loss(labels.numpy(), p.numpy(), labels=list(range(5)))
    assert nll_of_probs(p, labels) == pytest.approx(ref, abs=1e-9)


# ---------------------------------------------------------------- calibrators


def nll(p: torch.Tensor, y: torch.Tensor) -> float:
    return float(-p.gather(1, y[:, None]).log().mean())


@pytest.mark.parametrize("seed", [0, 1])
def test_temperature_matches_netcal(seed, quiet):
    scaling = pytest.importorskip("netcal.scaling")
    logits, labels = case(seed, c=5, scale=2.0 + seed)
    test, _ = case(seed + 10, n=300, c=5, scale=2.0 + seed)
    ours = Temperature().fit(logits, labels)
    ref = scaling.TemperatureScaling()
    ref.fit(F.softmax(logits, 1).numpy(), labels.numpy())
    # netcal fits softmax(w·log p) by scipy's L-BFGS-B with numeric gradients: T = 1/w
    assert ours.t == pytest.approx(1 / float(ref.weights[0]), rel=1e-5)
    t_ref = 1 / float(ref.weights[0])
    assert (
        nll(F.softmax(logits / ours.t, 1), labels)
        <= nll(F.softmax(logits / t_ref, 1), labels) + 1e-12
    )
    p_ref = torch.from_numpy(ref.transform(F.softmax(test, 1).numpy()))
    assert torch.allclose(ours.probs(test), p_ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_vector_scaling_matches_netcal(seed, quiet):
    scaling = pytest.importorskip("netcal.scaling")
    logits, labels = case(seed, c=5)
    test, _ = case(seed + 10, n=300, c=5)
    ours = VectorScaling().fit(logits, labels)
    # netcal's multi-class LogisticCalibration is vector scaling of log p: w ⊙ log p + b
    ref = scaling.LogisticCalibration(method="mle")
    ref.fit(F.softmax(logits, 1).numpy(), labels.numpy())
    w, b = (torch.as_tensor(np.asarray(v, dtype=np.float64)) for v in (ref.weights, ref.intercept))
    x = F.log_softmax(logits, 1)
    objective = float(F.cross_entropy(x * ours.w + ours.b, labels))
    assert objective <= float(F.cross_entropy(x * w + b, labels)) + 1e-9
    p_ref = torch.from_numpy(ref.transform(F.softmax(test, 1).numpy()))
    assert torch.allclose(ours.probs(test), p_ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_dirichlet_odir_matches_torch_uncertainty(seed, quiet):
    pp = pytest.importorskip("torch_uncertainty.post_processing")
    data = pytest.importorskip("torch.utils.data")
    c = 5
    logits, labels = case(seed, c=c)
    test, _ = case(seed + 10, n=300, c=c)
    ours = DirichletScaling().fit(logits, labels)
    # the same model and ODIR penalty: softmax(W log p + b), λ/(C(C−1))·Σ_{i≠j} W_ij² + μ·mean b²
    ref = pp.DirichletScaler(
        num_classes=c, lambda_reg=ODIR_LAMBDA, mu_reg=ODIR_MU, lr=1.0, max_iter=2000
    ).double()
    ref.fit(data.DataLoader(data.TensorDataset(logits, labels), batch_size=4096), progress=False)
    weight, bias = ref.inv_temperature_weight.detach(), ref.inv_temperature_bias.detach()
    x, off = F.log_softmax(logits, 1), 1 - torch.eye(c, dtype=torch.float64)

    def objective(w: torch.Tensor, b: torch.Tensor) -> float:
        penalty = ODIR_LAMBDA * (w * off).pow(2).sum() / (c * (c - 1)) + ODIR_MU * b.pow(2).mean()
        return float(F.cross_entropy(x @ w.T + b, labels) + penalty)

    assert objective(ours.weight, ours.bias) <= objective(weight, bias) + 1e-9
    assert objective(ours.weight, ours.bias) == pytest.approx(objective(weight, bias), abs=1e-6)
    with torch.no_grad():
        p_ref = F.softmax(ref(test), 1)
    assert torch.allclose(ours.probs(test), p_ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_histogram_binning_matches_torch_uncertainty(seed, quiet):
    pp = pytest.importorskip("torch_uncertainty.post_processing")
    data = pytest.importorskip("torch.utils.data")
    logits, labels = case(seed, n=3000, c=4)
    test, _ = case(seed + 10, n=400, c=4)
    ours = HistogramBinning().fit(logits, labels).probs(test)
    ref = pp.HistogramBinningScaler(num_bins=15)
    ref.fit(data.DataLoader(data.TensorDataset(logits, labels), batch_size=4096), progress=False)
    # one-vs-rest on 15 equal-width bins, empty bin = its centre, renormalised; it stores the
    # bin frequencies in float32 and returns log(clamp(p, 1e-6, 1 - 1e-6))
    p_ref = ref(test).exp().double()
    assert torch.allclose(ours.clamp(1e-6, 1 - 1e-6), p_ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_isotonic_regression_matches_sklearn_one_vs_rest(seed):
    isotonic = pytest.importorskip("sklearn.isotonic")
    logits, labels = case(seed, n=2000, c=4)
    logits[:300] = logits[:300].round()  # repeated probabilities: sklearn pools them
    test, _ = case(seed + 10, n=400, c=4, scale=2.5)  # some beyond the fitted range
    p_val, p_test = F.softmax(logits, 1).numpy(), F.softmax(test, 1).numpy()
    columns = []
    for k in range(4):
        ir = isotonic.IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip")
        ir.fit(p_val[:, k], (labels.numpy() == k).astype(float))
        columns.append(ir.predict(p_test[:, k]))
    q = np.stack(columns, axis=1)
    ref = torch.from_numpy(q / q.sum(1, keepdims=True))
    ours = IsotonicRegression().fit(logits, labels).probs(test)
    assert torch.allclose(ours, ref, atol=1e-12, rtol=0)


def test_probability_metrics_of_a_reference_calibrator_output():
    """The report function takes any calibrated probabilities: sklearn's isotonic output gives
    the same numbers as ours (one more independent path into probability_metrics)."""
    isotonic = pytest.importorskip("sklearn.isotonic")
    logits, labels = case(4, n=1000, c=3)
    p = F.softmax(logits, 1).numpy()
    q = np.stack(
        [
            isotonic.IsotonicRegression(y_min=0, y_max=1, out_of_bounds="clip")
            .fit(p[:, k], (labels.numpy() == k).astype(float))
            .predict(p[:, k])
            for k in range(3)
        ],
        axis=1,
    )
    ref = probability_metrics(torch.from_numpy(q / q.sum(1, keepdims=True)), labels)
    ours = probability_metrics(IsotonicRegression().fit(logits, labels).probs(logits), labels)
    assert ours == pytest.approx(ref, abs=1e-9)
