"""Losses of docs/methods.md §3/§6 against hand-derived values and independent formulas."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from models.losses import (
    LOSSES,
    build_loss,
    dense_soft_targets,
    mixup_batch,
    mixup_loss,
    mmce_squared,
    mmd_weighted,
    soft_l2,
)


@pytest.fixture
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 5, generator=g) * 3, torch.randint(0, 5, (16,), generator=g)


def test_registry_lists_baselines_and_rejects_unknown():
    assert {"ce", "ls", "focal", "flsd53", "mbls", "mmce", "mmce_weighted"} <= set(LOSSES)
    with pytest.raises(ValueError, match="valid: ce, ls"):
        build_loss("nope", 3)
    with pytest.raises(ValueError, match="unknown \\['beta'\\]"):
        build_loss("ls", 3, beta=0.1)
    with pytest.raises(ValueError, match="alpha"):
        build_loss("ls", 3, alpha=1.5)


@pytest.mark.parametrize("name", list(LOSSES))
def test_every_loss_has_exact_gradients_and_ignores_a_logit_shift(name):
    """Autograd's gradient equals the finite-difference one (no detached or mis-derived term),
    and every loss is a function of the softmax / logit gaps: adding a constant to a sample's
    logits changes nothing, so each row of the gradient sums to 0."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 4, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, 4, (8,), generator=g)
    y[:3] = logits[:3].argmax(1)  # both right and wrong predictions (MMCE-weighted needs both)
    y[3] = (logits[3].argmax() + 1) % 4
    loss_fn = build_loss(name, 4)
    s = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: loss_fn(t, y), (s,), eps=1e-6, atol=1e-6)
    shift = torch.randn(8, 1, generator=g, dtype=torch.float64) * 5
    assert loss_fn(logits + shift, y).item() == pytest.approx(loss_fn(logits, y).item(), rel=1e-9)
    (grad,) = torch.autograd.grad(loss_fn(s, y), s)
    assert grad.sum(1).abs().max().item() < 1e-12


def test_ce_on_two_class_hand_value():
    # logits (0, ln 3): p = (1/4, 3/4); label 1 -> -ln(3/4), label 0 -> -ln(1/4).
    s = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    loss = build_loss("ce", 2)(s, torch.tensor([1, 0]))
    assert loss.item() == pytest.approx((-math.log(0.75) - math.log(0.25)) / 2, rel=1e-6)


def test_ls_matches_smoothed_target_and_reduces_to_ce(batch):
    logits, y = batch
    ce = F.cross_entropy(logits, y)
    assert build_loss("ls", 5, alpha=0.0)(logits, y).item() == pytest.approx(ce.item(), rel=1e-6)
    alpha = 0.1
    target = (1 - alpha) * F.one_hot(y, 5) + alpha / 5
    expected = -(target * F.log_softmax(logits, 1)).sum(1).mean()
    got = build_loss("ls", 5, alpha=alpha)(logits, y)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)


def test_focal_gamma_zero_is_ce_and_hand_value(batch):
    logits, y = batch
    ce = F.cross_entropy(logits, y).item()
    assert build_loss("focal", 5, gamma=0.0)(logits, y).item() == pytest.approx(ce, rel=1e-6)
    # p_y = 3/4, γ = 3: -(1/4)^3 · ln(3/4)
    s = torch.tensor([[0.0, math.log(3.0)]])
    got = build_loss("focal", 2)(s, torch.tensor([1])).item()
    assert got == pytest.approx(-(0.25**3) * math.log(0.75), rel=1e-6)


@pytest.mark.parametrize("gamma", [0.5, 1.0, 3.0])
def test_focal_gradient_stays_finite_where_a_sample_is_certain(gamma):
    # the first sample's p_y rounds to exactly 1 in float32: (1 - p)^γ has an infinite slope
    # there when γ < 1, and its product with log p = 0 must not turn the batch's gradient NaN
    logits = torch.tensor([[0.0, 200.0], [0.0, math.log(3.0)]], requires_grad=True)
    y = torch.tensor([1, 1])
    assert F.softmax(logits, 1)[0, 1].item() == 1.0
    loss = build_loss("focal", 2, gamma=gamma)(logits, y)
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    # the certain sample adds nothing; the other keeps its value and gradient
    alone = logits.detach()[1:].clone().requires_grad_(True)
    (build_loss("focal", 2, gamma=gamma)(alone, y[1:]) / 2).backward()
    assert loss.item() == pytest.approx(-(0.25**gamma) * math.log(0.75) / 2, rel=1e-6)
    assert torch.allclose(logits.grad[1], alone.grad[0], atol=1e-7)
    assert torch.equal(logits.grad[0], torch.zeros(2))


def test_flsd53_switches_gamma_at_p_02():
    # two classes with p_y = 0.1 (below 0.2 -> γ=5) and p_y = 0.3, 0.2 (-> γ=3)
    def logits_for(p: float) -> torch.Tensor:
        return torch.tensor([[math.log(1 - p), math.log(p)]])

    flsd = build_loss("flsd53", 2)
    for p, gamma in [(0.1, 5), (0.19, 5), (0.2, 3), (0.3, 3), (0.9, 3)]:
        got = flsd(logits_for(p), torch.tensor([1])).item()
        assert got == pytest.approx(-((1 - p) ** gamma) * math.log(p), rel=1e-5), p


def test_mbls_zero_penalty_inside_margin_and_hand_value():
    s = torch.tensor([[1.0, 0.0, -2.0], [0.5, 3.0, 2.0]])
    y = torch.tensor([0, 1])
    ce = F.cross_entropy(s, y).item()
    # all gaps <= 3 < m = 6: MbLS is plain CE
    assert build_loss("mbls", 3)(s, y).item() == pytest.approx(ce, rel=1e-6)
    # m = 1: gaps row0 (0, 1, 3) -> relu(-1, 0, 2); row1 (2.5, 0, 1) -> relu(1.5, -1, 0)
    penalty = (2.0 + 1.5) / 6
    got = build_loss("mbls", 3, m=1.0, lam=0.5)(s, y).item()
    assert got == pytest.approx(ce + 0.5 * penalty, rel=1e-6)


def test_mmce_matches_pairwise_formula(batch):
    logits, y = batch
    p = F.softmax(logits, 1)
    c, pred = p.max(1)
    a = (pred == y).float()
    expected = 0.0
    for i in range(len(y)):
        for j in range(len(y)):
            k = math.exp(-abs(c[i].item() - c[j].item()) / 0.4)
            expected += (a[i] - c[i]).item() * (a[j] - c[j]).item() * k
    expected /= len(y) ** 2
    assert mmce_squared(logits, y).item() == pytest.approx(expected, rel=1e-5)
    # docs/methods.md §6: the unweighted form is NLL + λ·MMCE_m, no square root
    loss = build_loss("mmce", 5, lam=3.0)(logits, y).item()
    nll = F.cross_entropy(logits, y).item()
    assert loss == pytest.approx(nll + 3.0 * expected, rel=1e-5)


def _weighted_mmd_by_loops(logits: torch.Tensor, y: torch.Tensor, width: float = 0.4) -> float:
    """Kumar et al.'s weighted estimator written out pair by pair."""
    c, pred = F.softmax(logits.double(), 1).max(1)
    c = c.tolist()
    good = [i for i in range(len(y)) if pred[i] == y[i]]
    bad = [i for i in range(len(y)) if pred[i] != y[i]]
    m, n = len(good), len(bad)

    def k(i: int, j: int) -> float:
        return math.exp(-abs(c[i] - c[j]) / width)

    cc = sum((1 - c[i]) * (1 - c[j]) * k(i, j) for i in good for j in good) / m**2
    ii = sum(c[i] * c[j] * k(i, j) for i in bad for j in bad) / n**2
    ci = sum((1 - c[i]) * c[j] * k(i, j) for i in good for j in bad) / (m * n)
    return cc + ii - 2 * ci


def test_weighted_mmce_matches_pairwise_formula(batch):
    logits, y = batch
    y = y.clone()
    y[:6] = logits[:6].argmax(1)  # make sure both groups are there
    expected = _weighted_mmd_by_loops(logits, y)
    assert expected > 0
    assert mmd_weighted(logits.double(), y).item() == pytest.approx(expected, rel=1e-9)
    loss = build_loss("mmce_weighted", 5, lam=3.0)(logits.double(), y).item()
    nll = F.cross_entropy(logits.double(), y).item()
    assert loss == pytest.approx(nll + 3.0 * math.sqrt(expected + 1e-10), rel=1e-9)
    # all correct (or none): the MMCE term is exactly 0
    all_right = logits.argmax(1)
    assert mmd_weighted(logits, all_right).item() == 0.0
    assert build_loss("mmce_weighted", 5)(logits, all_right).item() == pytest.approx(
        F.cross_entropy(logits, all_right).item(), rel=1e-6
    )


# 8 samples, 3 classes: predictions 0, 1, 2, 1, 0, 1, 0, 1, so 5 right (rows 0, 1, 4, 5, 7), 3 wrong
MMCE_LOGITS = [
    [2.0, 0.5, -1.0],
    [0.2, 1.5, 0.3],
    [-0.5, 0.0, 2.5],
    [1.0, 1.2, 0.8],
    [3.0, -1.0, 0.0],
    [0.0, 0.4, 0.1],
    [1.5, 0.2, 1.4],
    [-1.0, 2.0, 0.5],
]
MMCE_LABELS = [0, 1, 0, 2, 0, 1, 2, 1]


def _focal_calibration_mmd_by_loops(rows: list[list[float]], labels: list[int]) -> float:
    """MMCE_weighted's squared term as torrvision/focal_calibration (Losses/mmce.py) computes it,
    step by step in plain Python: each group's kernel·weight pair matrix is averaged (its mean),
    then divided again by (pair count + 1e-5)."""
    conf, pred = [], []
    for row in rows:
        z = [math.exp(v - max(row)) for v in row]
        p = [v / sum(z) for v in z]
        conf.append(max(p))
        pred.append(p.index(max(p)))
    good = [conf[i] for i in range(len(labels)) if pred[i] == labels[i]]
    bad = [conf[i] for i in range(len(labels)) if pred[i] != labels[i]]
    m, n = len(good), len(bad)

    def k(a: float, b: float) -> float:
        return math.exp(-abs(a - b) / 0.4)

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    correct_correct = mean([k(a, b) * (1 - a) * (1 - b) for a in good for b in good])
    incorrect_incorrect = mean([k(a, b) * a * b for a in bad for b in bad])
    correct_incorrect = mean([k(a, b) * (1 - a) * b for a in good for b in bad])
    return (
        correct_correct / (m * m + 1e-5)
        + incorrect_incorrect / (n * n + 1e-5)
        - 2.0 * correct_incorrect / (m * n + 1e-5)
    )


def test_weighted_mmce_focal_calibration_normalization_matches_that_code():
    """normalization="focal_calibration" is MMCE_weighted of torrvision/focal_calibration.

    Cross-check of the transcription: that file itself (Losses/mmce.py at 475422a, run apart
    with this venv's torch) gives 0.114614688 on this batch in float32 (0.114614690 in float64,
    where its m·m + 1e-5 stays float32); sqrt(loops + 1e-10) here is 0.114614688. The paper's
    normalisation gives 0.271706853 on the same batch.
    """
    logits, y = torch.tensor(MMCE_LOGITS, dtype=torch.float64), torch.tensor(MMCE_LABELS)
    expected = _focal_calibration_mmd_by_loops(MMCE_LOGITS, MMCE_LABELS)
    assert expected > 0
    got = mmd_weighted(logits, y, normalization="focal_calibration").item()
    assert got == pytest.approx(expected, rel=1e-9)
    got32 = mmd_weighted(logits.float(), y, normalization="focal_calibration").item()
    assert got32 == pytest.approx(expected, abs=1e-6)
    nll = F.cross_entropy(logits, y).item()
    fc = build_loss("mmce_weighted", 3, lam=3.0, normalization="focal_calibration")
    assert fc(logits, y).item() == pytest.approx(nll + 3.0 * math.sqrt(expected + 1e-10), rel=1e-9)
    assert fc(logits.float(), y).item() == pytest.approx(
        nll + 3.0 * math.sqrt(expected + 1e-10), abs=1e-6
    )
    # the paper's normalisation stays the default, matches its own loops, and differs
    paper = _weighted_mmd_by_loops(logits, y)
    assert mmd_weighted(logits, y).item() == pytest.approx(paper, rel=1e-9)
    default = build_loss("mmce_weighted", 3, lam=3.0)
    assert default(logits, y).item() == pytest.approx(
        nll + 3.0 * math.sqrt(paper + 1e-10), rel=1e-9
    )
    assert math.sqrt(paper + 1e-10) > 2.0 * math.sqrt(expected + 1e-10)
    # all right: no MMCE term either; exact gradients; unknown names refused
    assert mmd_weighted(logits, logits.argmax(1), normalization="focal_calibration").item() == 0.0
    s = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: fc(t, y), (s,), eps=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="normalization='sum' is not valid; choose one of: paper"):
        build_loss("mmce_weighted", 3, normalization="sum")
    with pytest.raises(ValueError, match="unknown \\['normalization'\\]"):
        build_loss("mmce", 3, normalization="paper")


def test_mmce_vanishes_when_calibrated():
    # four samples at confidence 0.75, three correct: a - c sums to 0 and the kernel is constant.
    s = torch.tensor([[math.log(3.0), 0.0]], dtype=torch.float64).repeat(4, 1)
    y = torch.tensor([0, 0, 0, 1])
    assert abs(mmce_squared(s, y).item()) < 1e-12
    loss = build_loss("mmce", 2)(s, y).item()
    assert loss == pytest.approx(F.cross_entropy(s, y).item(), abs=1e-9)


def test_soft_l2_and_dense_targets():
    classes = torch.tensor([[0, 2], [1, 1]])
    soft = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    t = dense_soft_targets(classes, soft, 3)
    assert torch.allclose(t, torch.tensor([[0.7, 0.0, 0.3], [0.0, 1.0, 0.0]]))
    # uniform prediction over 3 classes: ||(1/3 - t)||² per row
    s = torch.zeros(2, 3)
    row0 = (1 / 3 - 0.7) ** 2 + (1 / 3) ** 2 + (1 / 3 - 0.3) ** 2
    row1 = 2 * (1 / 3) ** 2 + (1 / 3 - 1) ** 2
    assert soft_l2(s, t).item() == pytest.approx((row0 + row1) / 2, rel=1e-6)
    assert soft_l2(torch.tensor([[50.0, 0.0, 0.0]]), torch.tensor([[1.0, 0, 0]])).item() < 1e-12
    with pytest.raises(ValueError, match="must match"):
        soft_l2(s, t[:, :2])


def test_mixup_is_deterministic_convex_and_loss_matches():
    x = torch.arange(24.0).reshape(6, 4)
    y = torch.arange(6)
    x1, ya, yb, lam = mixup_batch(x, y, 0.4, torch.Generator().manual_seed(3))
    x2, _, yb2, lam2 = mixup_batch(x, y, 0.4, torch.Generator().manual_seed(3))
    assert torch.equal(x1, x2) and torch.equal(yb, yb2) and lam == lam2
    assert 0.0 <= lam <= 1.0 and torch.equal(ya, y)
    assert sorted(yb.tolist()) == y.tolist()  # a permutation
    assert torch.allclose(x1, lam * x + (1 - lam) * x[yb])  # y = index here, so y_b = π
    logits = torch.randn(6, 6, generator=torch.Generator().manual_seed(1))
    expected = lam * F.cross_entropy(logits, ya) + (1 - lam) * F.cross_entropy(logits, yb)
    assert mixup_loss(logits, ya, yb, lam).item() == pytest.approx(expected.item())
    with pytest.raises(ValueError, match="alpha"):
        mixup_batch(x, y, 0.0, torch.Generator())
