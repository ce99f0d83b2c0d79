"""Selective classification: the risk-coverage curve and its summaries (docs/evaluate.md).

A classifier that may abstain answers its k most confident samples (confidence κ_i = max softmax)
and abstains on the rest; coverage = k/N. With the samples sorted by decreasing confidence and
E_k = the number of errors among the first k:

    selective risk   r_k = E_k / k        (Geifman & El-Yaniv 2017)
    generalised risk g_k = E_k / N        (Traub et al. 2024: errors per sample of the whole set)
    AURC  = (1/N) Σ_k r_k                 AUGRC = (1/N) Σ_k g_k = (1/N) Σ_k (k/N)·r_k
    risk at coverage c = r_k at k = ⌈c·N⌉

The areas are the means over the N coverages k/N, k = 1..N (a left Riemann sum of the curve
from the right). torch-uncertainty integrates the same points by trapezoid and divides by
(1 − 1/N): its AURC = (Σ_k r_k − (r_1 + r_N)/2) / (N − 1), likewise its AUGRC with g_k; both
tend to ours as N grows, and tests/test_reference_metrics.py checks the exact relation.
Ties in confidence are broken by sample order (a stable sort), as a ranking must break them.
All inputs are 1-D tensors; everything is float64 on the CPU; results are fractions in [0, 1].
"""

from __future__ import annotations

import math

import torch


def risk_curves(confidence: torch.Tensor, correct: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(r_k, g_k) for k = 1..N: selective and generalised risk of the k most confident."""
    c = confidence.detach().to("cpu", torch.float64).flatten()
    if c.numel() == 0:
        raise ValueError("the risk-coverage curve needs at least one sample")
    err = 1.0 - correct.detach().to("cpu", torch.float64).flatten()
    order = torch.sort(c, descending=True, stable=True).indices
    errors = torch.cumsum(err[order], 0)  # E_k
    k = torch.arange(1, c.numel() + 1, dtype=torch.float64)
    return errors / k, errors / c.numel()


def aurc(confidence: torch.Tensor, correct: torch.Tensor) -> float:
    """Area under the risk-coverage curve: the mean of r_k over k = 1..N."""
    return float(risk_curves(confidence, correct)[0].mean())


def augrc(confidence: torch.Tensor, correct: torch.Tensor) -> float:
    """Area under the generalised risk-coverage curve: the mean of g_k = E_k/N over k = 1..N."""
    return float(risk_curves(confidence, correct)[1].mean())


def risk_at_coverage(
    confidence: torch.Tensor, correct: torch.Tensor, coverage: float = 0.8
) -> float:
    """Selective risk r_k of the k = ⌈coverage·N⌉ most confident samples (k >= 1)."""
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    risk = risk_curves(confidence, correct)[0]
    k = max(1, math.ceil(coverage * risk.numel() - 1e-9))  # 1e-9: 0.8·N is not always exact
    return float(risk[k - 1])
