"""FeDLaS fine-tuning math (docs/methods.md §5): feature-modulated bidirectional label smoothing.
Per sample, a confidence indicator on the features (NCI) and a direction gate on the logits set
the smoothing weight r_i ∈ (0, 2α) of label smoothing (LS) or margin-based smoothing (MbLS).

Pure torch, no I/O. The finetune stage runs it as a training objective (models/objectives.py);
one step:

    loss, stats = criterion(features, logits, labels)   # gate params live in the main optimizer
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class NCI(nn.Module):
    """Normalised confidence indicator γ_i = (n_i − μ)/(σ + 1e-3), n_i = ‖z_i‖₁ (docs/methods.md §5).

    In training mode only, once per call and before normalising, μ and σ take an EMA step towards
    the batch mean and unbiased std of n (weight θ). They are buffers, so checkpoints keep them.
    A training batch of one sample has no unbiased std: σ is then left as it is (no NaN).
    """

    def __init__(self, theta: float, mu0: float = 20.0, sigma0: float = 100.0) -> None:
        super().__init__()
        if not 0.0 < theta <= 1.0:
            raise ValueError(f"theta must lie in (0, 1], got {theta}")
        self.theta = theta
        self.register_buffer("mu", torch.tensor(float(mu0)))
        self.register_buffer("sigma", torch.tensor(float(sigma0)))

    def forward(self, z: Tensor) -> Tensor:
        if z.ndim < 2:
            raise ValueError(f"features must be [B, ...], got shape {tuple(z.shape)}")
        n = z.detach().flatten(1).float().abs().sum(dim=1)
        if self.training:
            th = self.theta
            self.mu.copy_(th * n.mean() + (1.0 - th) * self.mu)
            if n.numel() > 1:
                self.sigma.copy_(th * n.std(correction=1) + (1.0 - th) * self.sigma)
        return (n - self.mu) / (self.sigma + 1e-3)


class _SignSTE(torch.autograd.Function):
    """ψ = sign(d) forward (0 at d = 0), identity gradient backward (straight-through)."""

    @staticmethod
    def forward(ctx: Any, d: Tensor) -> Tensor:
        return torch.sign(d)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


class FeDLaSGate(nn.Module):
    """Direction gate on detached logits: C → ⌊C/2⌋ (LeakyReLU 0.01) → 2, softmax π,
    d = π₁ − π₀, ψ = sign(d) with a straight-through gradient (docs/methods.md §5).

    The logits are detached so the gate only steers r_i; it learns through the task loss alone.
    """

    def __init__(self, num_classes: int, *, generator: torch.Generator | None = None) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"the gate needs num_classes >= 2, got {num_classes}")
        hidden = num_classes // 2
        self.mlp = nn.Sequential(
            nn.Linear(num_classes, hidden), nn.LeakyReLU(0.01), nn.Linear(hidden, 2)
        )
        if generator is not None:
            with torch.no_grad():
                for layer in (self.mlp[0], self.mlp[2]):
                    bound = 1.0 / math.sqrt(layer.in_features)
                    layer.weight.uniform_(-bound, bound, generator=generator)
                    layer.bias.uniform_(-bound, bound, generator=generator)

    def forward(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Return (ψ, d), both [B]."""
        pi = self.mlp(logits.detach()).softmax(dim=-1)
        d = pi[:, 1] - pi[:, 0]
        return _SignSTE.apply(d), d


def smoothing_weights(psi: Tensor, gamma: Tensor, alpha: float, beta: float) -> Tensor:
    """r_i = 2α·sigmoid(β·ψ_i·γ_i) ∈ (0, 2α); r_i = α at β = 0 or ψ_i = 0 (docs/methods.md §5)."""
    return 2.0 * alpha * torch.sigmoid(beta * psi * gamma)


def _check_inputs(logits: Tensor, labels: Tensor, r: Tensor) -> None:
    b = logits.shape[0]
    if logits.ndim != 2 or labels.shape != (b,) or r.shape != (b,):
        raise ValueError(
            f"need logits [B, C], labels [B], r [B]; got {tuple(logits.shape)}, "
            f"{tuple(labels.shape)}, {tuple(r.shape)}"
        )


def fedlas_ls_loss(logits: Tensor, labels: Tensor, r: Tensor) -> Tensor:
    """FeDLaS-LS: mean_i[(1 − r_i)·CE_i + r_i·(−(1/C)·Σ_k log p_ik)] (docs/methods.md §5)."""
    _check_inputs(logits, labels, r)
    logp = logits.float().log_softmax(dim=-1)
    ce = -logp.gather(1, labels[:, None]).squeeze(1)
    uniform = -logp.mean(dim=1)
    return ((1.0 - r) * ce + r * uniform).mean()


def fedlas_mbls_loss(logits: Tensor, labels: Tensor, r: Tensor, margin: float) -> Tensor:
    """FeDLaS-MbLS: mean_i[(1 − r_i)·CE_i] + mean_i[r_i·(1/C)·Σ_k max(0, max_l s_il − s_ik − m)]."""
    _check_inputs(logits, labels, r)
    s = logits.float()
    ce = F.cross_entropy(s, labels, reduction="none")
    gaps = F.relu(s.max(dim=1, keepdim=True).values - s - margin).mean(dim=1)
    return ((1.0 - r) * ce).mean() + (r * gaps).mean()


FEDLAS_LOSSES: dict[str, Callable[..., Tensor]] = {"ls": fedlas_ls_loss, "mbls": fedlas_mbls_loss}

# Order of stats["mode_share"].
GATE_MODES = ("+1", "-1", "0")


class FeDLaSCriterion(nn.Module):
    """The FeDLaS loss with its NCI and gate (docs/methods.md §5): forward(z, s, y) -> (loss, stats).

    Trainer duties: add `gate_parameters()` to the main optimizer (same lr schedule and weight
    decay) and leave them out of gradient clipping; call `.train()` / `.eval()` with the model
    (μ, σ move in training mode only); save `state_dict()` with the checkpoint.
    stats (all detached tensors): psi [B] (for flip rates), r [B], gamma [B],
    mode_share [3] = share of samples with ψ = +1, −1, 0 (order GATE_MODES).
    """

    def __init__(
        self,
        num_classes: int,
        variant: str = "ls",
        *,
        alpha: float,
        beta: float,
        theta: float,
        margin: float | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if variant not in FEDLAS_LOSSES:
            raise ValueError(
                f"unknown FeDLaS variant {variant!r}; choose one of {list(FEDLAS_LOSSES)}"
            )
        if (variant == "mbls") != (margin is not None):
            raise ValueError("margin is required for variant='mbls' and only valid there")
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        self.variant, self.alpha, self.beta, self.margin = variant, alpha, beta, margin
        self.nci = NCI(theta)
        self.gate = FeDLaSGate(num_classes, generator=generator)
        loss = FEDLAS_LOSSES[variant]
        self._loss = loss if margin is None else partial(loss, margin=margin)

    def gate_parameters(self) -> list[nn.Parameter]:
        return list(self.gate.parameters())

    def forward(
        self, features: Tensor, logits: Tensor, labels: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        gamma = self.nci(features)
        psi, _ = self.gate(logits)
        r = smoothing_weights(psi, gamma, self.alpha, self.beta)
        loss = self._loss(logits, labels, r)
        with torch.no_grad():
            share = torch.stack([psi > 0, psi < 0, psi == 0]).float().mean(dim=1)
        stats = {"psi": psi.detach(), "r": r.detach(), "gamma": gamma, "mode_share": share}
        return loss, stats
