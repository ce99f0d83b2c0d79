"""Training losses of the baselines (docs/methods.md §6) and the CSM synthetic term (docs/methods.md §3).

Notation: logits s [N, C], p = softmax(s), labels y [N] (int64), c_i = max_k p_ik.

Each loss is one class, `cls(num_classes, params)`, whose `forward(logits, labels) -> scalar` is
the mean over the batch; its parameters are its own frozen dataclass `cls.Params` (defaults,
bounds and choices stated once: core/parts.py), which the train config's fields derive from. The
registry `LOSSES` maps a flag to the class; `build_loss(name, C, **params)` builds one. Defaults
(docs/methods.md §6, CIFAR values):

| name   | params (default)                  | loss                                                   |
|--------|-----------------------------------|--------------------------------------------------------|
| ce     | -                                 | CE                                                     |
| ls     | alpha=0.05                        | (1-α)·CE + α·(1/C)Σ_k -log p_k                         |
| focal  | gamma=3.0                         | -(1-p_y)^γ log p_y                                     |
| flsd53 | gamma_below=5, gamma=3, threshold=0.2 | focal with γ=5 where p_y < 0.2, else γ=3           |
| mbls   | m=6.0, lam=0.1 (Tiny: m=10, 0.05) | CE + λ·(1/C)Σ_k relu(max_l s_l - s_k - m)               |
| mmce   | lam=2.0, width=0.4                | NLL + λ·MMCE_m (unweighted, no root), Laplacian kernel  |
| mmce_weighted | lam=2.0, width=0.4, normalization="paper" | NLL + λ·sqrt(MMD_w + 1e-10), correct/incorrect weighted |

(`lam` stands for λ: `lambda` is a Python keyword; MMCE's kernel width and FLSD-53's threshold
are part of the methods' definitions, not parameters.) The LS α is a GUESS (docs/methods.md leaves it open;
0.05 matches FeDLaS-LS's CIFAR-10 value); MMCE's λ is the low end of docs/methods.md's 2-4.
`mmce_weighted`'s normalization="focal_calibration" is the MMD_w of the baselines later papers
report (torrvision/focal_calibration), which divides its pair sums differently (`mmd_weighted`).

Every class here is also a train loss (models/objectives.OBJECTIVES wraps each in a
`CriterionObjective`); losses that need more than (logits, labels) are objectives there: `csm`
(CE on real + w·`soft_l2` on synthetic, separate forward passes), `mixup` (a batch transform,
`mixup_batch`, plus `mixup_loss`) and `fedlas-*` (models/fedlas.py's criterion).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from core.config import OFF_DEFAULT, ConfigError
from core.parts import Params, param


def _focal(logits: torch.Tensor, labels: torch.Tensor, gamma: torch.Tensor | float) -> torch.Tensor:
    """mean_i -(1 - p_iy)^γ_i · log p_iy (Lin et al.; γ may be per sample). 1 - p_iy is held
    above the smallest normal float: at p_iy = 1, (1 - p)^γ with γ < 1 has an infinite slope,
    and its product with log p = 0 would make every gradient NaN; the held value only enters
    where 1 - p is exactly 0, whose term and gradient are 0 either way."""
    log_p_y = F.log_softmax(logits, dim=1).gather(1, labels[:, None]).squeeze(1)
    doubt = (1.0 - log_p_y.exp()).clamp_min(torch.finfo(log_p_y.dtype).tiny)
    return (-(doubt**gamma) * log_p_y).mean()


class CrossEntropy(nn.Module):
    """Plain CE (the NLL of the logits)."""

    @dataclass(frozen=True)
    class Params(Params):
        pass

    def __init__(self, num_classes: int, params: Params | None = None) -> None:
        super().__init__()
        self.num_classes = num_classes

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels)


class LabelSmoothing(nn.Module):
    """CE against the target (1-α)·onehot(y) + α/C, written as (1-α)·CE + α·uniform-CE."""

    @dataclass(frozen=True)
    class Params(Params):
        alpha: float = param(
            0.05, low=0.0, high=1.0, high_open=True, doc="ls: α of (1-α)·CE + α·uniform CE"
        )

    def __init__(self, num_classes: int, params: Params | None = None) -> None:
        super().__init__()
        self.num_classes, self.alpha = num_classes, (params or self.Params()).alpha

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        log_p = F.log_softmax(logits, dim=1)
        ce = -log_p.gather(1, labels[:, None]).squeeze(1)
        uniform = -log_p.mean(dim=1)
        return ((1.0 - self.alpha) * ce + self.alpha * uniform).mean()


class FocalLoss(nn.Module):
    """Focal loss with fixed γ (docs/methods.md §6: γ = 3)."""

    @dataclass(frozen=True)
    class Params(Params):
        gamma: float = param(3.0, low=0.0, doc="focal: γ of -(1-p_y)^γ log p_y")

    def __init__(self, num_classes: int, params: Params | None = None) -> None:
        super().__init__()
        self.num_classes, self.gamma = num_classes, (params or self.Params()).gamma

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _focal(logits, labels, self.gamma)


class FLSD53(nn.Module):
    """Sample-dependent focal loss (Mukhoti et al.): γ_i = 5 if p_iy < 0.2 else 3.

    The schedule is piecewise constant in p_y, so it is chosen on detached probabilities.
    """

    threshold = 0.2  # the "53" of the name: γ = 5 below p_y = 0.2, else 3

    @dataclass(frozen=True)
    class Params(Params):
        gamma_below: float = param(
            5.0, low=0.0, field="flsd_gamma_below", doc="FLSD-53: γ where p_y < 0.2"
        )
        gamma: float = param(3.0, low=0.0, field="flsd_gamma", doc="FLSD-53: γ elsewhere")

    def __init__(self, num_classes: int, params: Params | None = None) -> None:
        super().__init__()
        params = params or self.Params()
        self.num_classes = num_classes
        self.gamma_below, self.gamma = params.gamma_below, params.gamma

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            p_y = F.softmax(logits, dim=1).gather(1, labels[:, None]).squeeze(1)
            gamma = torch.where(p_y < self.threshold, self.gamma_below, self.gamma).to(logits.dtype)
        return _focal(logits, labels, gamma)


class MarginLabelSmoothing(nn.Module):
    """MbLS (Liu et al. 2022): CE + λ·mean_{i,k} relu(max_l s_il - s_ik - m).

    Only logit gaps wider than the margin m are penalised, so confident-but-bounded logits are
    left alone (unlike LS, which pulls every logit towards equality).
    """

    @dataclass(frozen=True)
    class Params(Params):
        m: float = param(6.0, low=0.0, field="mbls_margin", doc="MbLS: the logit-gap margin m")
        lam: float = param(0.1, low=0.0, doc="MbLS: λ of the margin term")

    def __init__(self, num_classes: int, params: Params | None = None) -> None:
        super().__init__()
        params = params or self.Params()
        self.num_classes, self.m, self.lam = num_classes, params.m, params.lam

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        gaps = logits.max(dim=1, keepdim=True).values - logits
        return F.cross_entropy(logits, labels) + self.lam * F.relu(gaps - self.m).mean()


def mmce_squared(logits: torch.Tensor, labels: torch.Tensor, width: float = 0.4) -> torch.Tensor:
    """MMCE² = (1/N²)Σ_ij (a_i - c_i)(a_j - c_j)·exp(-|c_i - c_j|/width) (Kumar et al. 2018).

    a_i = 1[ŷ_i = y_i] carries no gradient; c_i does. The Laplacian kernel is positive definite,
    so the value is >= 0 up to rounding.
    """
    c, y_hat = F.softmax(logits, dim=1).max(dim=1)
    r = (y_hat == labels).to(c.dtype) - c
    kernel = torch.exp(-(c[:, None] - c[None, :]).abs() / width)
    return (r[:, None] * r[None, :] * kernel).sum() / c.numel() ** 2


Normalization = Literal["paper", "focal_calibration"]
MMCE_NORMALIZATIONS: tuple[str, ...] = get_args(Normalization)
FOCAL_CALIBRATION_EPS = 1e-5  # the constant torrvision/focal_calibration adds to its denominators


def _check_normalization(normalization: str) -> None:
    if normalization not in MMCE_NORMALIZATIONS:
        raise ValueError(
            f"normalization must be one of {', '.join(MMCE_NORMALIZATIONS)}, got {normalization!r}"
        )


def mmd_weighted(
    logits: torch.Tensor, labels: torch.Tensor, width: float = 0.4, normalization: str = "paper"
) -> torch.Tensor:
    """Kumar et al.'s weighted estimator: with m correct samples C and n incorrect ones I,

        MMD_w = Σ_{i,j∈C} (1−c_i)(1−c_j)k_ij / m² + Σ_{i,j∈I} c_i c_j k_ij / n²
                − 2 Σ_{i∈C, j∈I} (1−c_i) c_j k_ij / (m·n),   k_ij = exp(−|c_i − c_j|/width),

    so both groups count equally however unbalanced the batch; 0 when all or none are correct.

    normalization="focal_calibration" is the estimator of MMCE_weighted in
    torrvision/focal_calibration (Losses/mmce.py), the code later papers' baselines run: each
    pair sum is averaged over its pairs and then divided again by (pair count + 1e-5),

        Σ_CC(…) / (m²·(m² + ε)) + Σ_II(…) / (n²·(n² + ε)) − 2 Σ_CI(…) / (m·n·(m·n + ε)),  ε = 1e-5,

    i.e. (up to ε) the same squared distance with the group weights (1−c_i)/m² and c_j/n² in
    place of (1−c_i)/m and c_j/n: a much smaller value, and not a fixed multiple of MMD_w.
    """
    _check_normalization(normalization)
    c, y_hat = F.softmax(logits, dim=1).max(dim=1)
    correct = (y_hat == labels).to(c.dtype)
    m, n = correct.sum(), (1.0 - correct).sum()
    if m == 0 or n == 0:
        return c.sum() * 0.0  # keeps the graph (and the dtype) for the caller's backward
    kernel = torch.exp(-(c[:, None] - c[None, :]).abs() / width)
    if normalization == "focal_calibration":
        a = correct * (1.0 - c)  # unnormalised group weights
        b = (1.0 - correct) * c
        eps = FOCAL_CALIBRATION_EPS  # divided in two steps: no count**4 in low precision
        return (
            (a @ kernel @ a) / (m * m) / (m * m + eps)
            + (b @ kernel @ b) / (n * n) / (n * n + eps)
            - 2.0 * (a @ kernel @ b) / (m * n) / (m * n + eps)
        )
    u = correct * (1.0 - c) / m  # correct samples: weight (1 − c_i)/m
    v = (1.0 - correct) * c / n  # incorrect samples: weight c_j/n
    return u @ kernel @ u + v @ kernel @ v - 2.0 * (u @ kernel @ v)


class MMCELoss(nn.Module):
    """NLL + λ·MMCE_m (docs/methods.md §6, the unweighted form, no square root)."""

    width = 0.4  # the Laplacian kernel's width (Kumar et al.; docs/methods.md §6)

    @dataclass(frozen=True)
    class Params(Params):
        lam: float = param(2.0, low=0.0, doc="mmce, mmce_weighted: λ of the MMCE term")

    def __init__(self, num_classes: int, params: Params | None = None) -> None:
        super().__init__()
        self.num_classes, self.lam = num_classes, (params or self.Params()).lam

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels) + self.lam * mmce_squared(logits, labels, self.width)


class WeightedMMCELoss(MMCELoss):
    """NLL + λ·sqrt(MMD_w + 1e-10) (docs/methods.md §6, the form the CIFAR-10 recipe uses); the MMCE
    term is 0 when all or none of the batch is correct. `normalization`: see `mmd_weighted`."""

    prefix = "mmce"  # its train fields: mmce_lam (mmce's too) and mmce_normalization

    @dataclass(frozen=True)
    class Params(MMCELoss.Params):
        # recorded only off its default: it came after the first runs (docs/train.md)
        normalization: Normalization = param(
            "paper",
            identity=OFF_DEFAULT,
            doc="mmce_weighted's pair-sum normalisation: paper (Kumar et al.) | focal_calibration "
            "(the torrvision/focal_calibration code later baselines use; docs/train.md)",
        )

    def __init__(self, num_classes: int, params: Params | None = None) -> None:
        params = params or self.Params()
        super().__init__(num_classes, params)
        self.normalization = params.normalization

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mmd = mmd_weighted(logits, labels, self.width, self.normalization)
        term = (mmd.clamp_min(0.0) + 1e-10).sqrt() if bool(mmd != 0) else mmd
        return F.cross_entropy(logits, labels) + self.lam * term


# flag -> the loss's class (train's `loss=`: models/objectives.OBJECTIVES takes each as it is)
LOSSES: dict[str, type[nn.Module]] = {
    "ce": CrossEntropy,
    "ls": LabelSmoothing,
    "focal": FocalLoss,
    "flsd53": FLSD53,
    "mbls": MarginLabelSmoothing,
    "mmce": MMCELoss,
    "mmce_weighted": WeightedMMCELoss,
}


def build_loss(name: str, num_classes: int, **params: float) -> nn.Module:
    """`LOSSES[name](num_classes, its Params(**params))`: params checked, unknown ones refused."""
    if name not in LOSSES:
        raise ConfigError(f"unknown loss {name!r}; valid: {', '.join(LOSSES)}")
    cls = LOSSES[name]
    return cls(num_classes, cls.Params.build(f"loss {name!r}", **params))


def soft_l2(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """CSM synthetic term (docs/methods.md §3): mean_j ||softmax(s̃_j) - t_j||²₂, targets dense [N, C]."""
    if logits.shape != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} must match"
        )
    return (F.softmax(logits, dim=1) - targets).pow(2).sum(dim=1).mean()


def dense_soft_targets(classes: torch.Tensor, soft: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Scatter a mixed sample's [t_a, t_b] on classes [a, b] (docs/architecture.md, Shard folders) into [N, C]."""
    out = torch.zeros(classes.shape[0], num_classes, dtype=soft.dtype, device=soft.device)
    return out.scatter_add_(1, classes.long(), soft)


def mixup_batch(
    x: torch.Tensor, y: torch.Tensor, alpha: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Mixup (Zhang et al. 2018): x̃ = λx + (1-λ)x[π], λ ~ Beta(α, α), π a random permutation.

    torch's Beta sampler takes no generator, so λ comes from a NumPy generator seeded by a draw
    from `generator`: the batch stays a pure function of the caller's torch generator.
    """
    if alpha <= 0:
        raise ValueError(f"mixup alpha must be > 0, got {alpha}")
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
    lam = float(np.random.default_rng(seed).beta(alpha, alpha))
    perm = torch.randperm(x.shape[0], generator=generator, device=generator.device).to(x.device)
    return lam * x + (1.0 - lam) * x[perm], y, y[perm], lam


def mixup_loss(
    logits: torch.Tensor, y_a: torch.Tensor, y_b: torch.Tensor, lam: float
) -> torch.Tensor:
    """λ·CE(s, y_a) + (1-λ)·CE(s, y_b): CE against the mixed one-hot target."""
    return lam * F.cross_entropy(logits, y_a) + (1.0 - lam) * F.cross_entropy(logits, y_b)
