"""Smooth ECE (Błasiok & Nakkiran, "Smooth ECE: Principled Reliability Diagrams via Kernel
Smoothing", 2023): a port of their reference package `relplot` (metrics.smECE, default
ReflectedGaussianKernel) to torch float64, step for step, so the numbers agree with it to
rounding (tests/test_reference_metrics.py).

With confidences f_i = max softmax and hits y_i = 1[correct], residuals r_i = f_i − y_i:

    r̂_σ(t) = Σ_i K_σ(t, f_i)·r_i / (Σ_i K_σ(t, f_i) + ε)     δ̂_σ(t) = Σ_i K_σ(t, f_i) + ε
    smECE_σ = Σ_t |r̂_σ(t)|·δ̂_σ(t) / Σ_t δ̂_σ(t)              (t on a mesh of [0, 1])

K_σ is a Gaussian of width σ reflected at 0 and 1 (so no mass leaves [0, 1]); as in relplot the
sums over samples are taken on a grid of M points (each f_i split linearly between its two
neighbours), convolved with the sampled kernel and interpolated linearly at the mesh t, and
ε = 1e-4. The bandwidth is the paper's fixed point σ* = smECE_σ*, found by relplot's rule: σ = 1
if 1 < smECE_1, else 10 bisection steps on (0, 1) keeping the end where σ >= smECE_σ (σ < 0.001
counts as a fixed point); smECE = smECE_σ*. It is a consistent estimator of the distance to
calibration, unlike binned ECE, which is biased upward on well-calibrated models and small sets.
"""

from __future__ import annotations

import math

import torch

EPS_DENSITY = 1e-4  # relplot's BaseKernelMixin.smooth eps
MIN_SIGMA = 1e-3  # relplot's smECE eps
MESH_POINTS = 200  # relplot config.smECE_mesh_pts
REFINE = 10  # bisection steps for σ*


def _to_grid(f: torch.Tensor, w: torch.Tensor, m: int) -> torch.Tensor:
    """Weights w at positions f in [0, 1], split linearly between the m grid points i/(m−1)."""
    x = f * (m - 1)
    i = x.long().clamp(0, m - 2)  # truncation = floor for x >= 0, as relplot's astype(int)
    frac = x - i
    out = torch.zeros(m, dtype=torch.float64)
    out.index_add_(0, i, (1 - frac) * w)
    out.index_add_(0, i + 1, frac * w)
    return out


def _reflected_convolution(values: torch.Tensor, sigma: float) -> torch.Tensor:
    """values on the m-point grid convolved with a Gaussian of width σ reflected at 0 and 1."""
    m = values.numel()
    t = torch.linspace(0, 1, m, dtype=torch.float64)
    kernel = torch.exp(-((t - 0.5) ** 2) / (2 * sigma**2)) / (math.sqrt(2 * math.pi) * sigma)
    ext = torch.cat([values.flip(0)[:-1], values, values.flip(0)[1:]])  # mirror images
    # numpy.convolve(ext, kernel, "valid")[m//2 : m//2 + m], through the FFT (same numbers to
    # rounding, and fast for the m ~ 10^4 of small σ): full convolution index j + m − 1
    n = ext.numel() + m - 1
    full = torch.fft.irfft(torch.fft.rfft(ext, n) * torch.fft.rfft(kernel, n), n)
    start = m - 1 + m // 2
    return full[start : start + m]


def _interpolate(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The piecewise-linear function through (i/(B−1), y_i), evaluated at t."""
    b = y.numel()
    step = 1 / (b - 1)
    i = (t * (b - 1)).long().clamp(0, b - 2)
    res = (t - i.to(torch.float64) * step) / step  # (long * float would be float32)
    return y[i] * (1 - res) + y[i + 1] * res


def _kernel_sum(f: torch.Tensor, w: torch.Tensor, t: torch.Tensor, sigma: float) -> torch.Tensor:
    """Σ_i K_σ(t, f_i)·w_i at the points t (relplot's GaussianKernel.apply)."""
    m = max(2000, round(20 / sigma)) // 2 + 1
    return _interpolate(t, _reflected_convolution(_to_grid(f, w, m), sigma))


def smooth_ece_at(confidence: torch.Tensor, correct: torch.Tensor, sigma: float) -> float:
    """smECE_σ at a fixed bandwidth σ (relplot's smECE_sigma)."""
    f = confidence.detach().to("cpu", torch.float64).flatten()
    r = f - correct.detach().to("cpu", torch.float64).flatten()
    t = torch.linspace(0, 1, max(round(10 / sigma), MESH_POINTS), dtype=torch.float64)
    density = _kernel_sum(f, torch.ones_like(f), t, sigma) + EPS_DENSITY
    r_hat = _kernel_sum(f, r, t, sigma) / density
    return float((r_hat.abs() * density).sum() / density.sum())


def smooth_ece_bandwidth(confidence: torch.Tensor, correct: torch.Tensor) -> float:
    """σ* = the fixed point σ = smECE_σ, by relplot's bisection (`search_param`)."""

    def below(sigma: float) -> bool:  # σ still below the fixed point
        return sigma < MIN_SIGMA or sigma < smooth_ece_at(confidence, correct, sigma)

    if below(1.0):
        return 1.0
    hi, lo = 1.0, 0.0
    for _ in range(REFINE):
        mid = (hi + lo) / 2
        if below(mid):
            lo = mid
        else:
            hi = mid
    return hi


def smooth_ece(confidence: torch.Tensor, correct: torch.Tensor) -> float:
    """Smooth ECE at its own bandwidth σ* (relplot's smECE), a fraction in [0, 1]."""
    return smooth_ece_at(confidence, correct, smooth_ece_bandwidth(confidence, correct))
