"""The denoising objective of the in-house UNet (fit-generator): what it predicts, and how each
sample's error is weighted. Torch only, so benchmarks and tests use it without a stage."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PREDICTION_TYPES = ("epsilon", "v_prediction")


def denoising_target(
    x0: torch.Tensor, eps: torch.Tensor, a_bar: torch.Tensor, prediction_type: str
) -> torch.Tensor:
    """ε, or v = √ᾱ·ε − √(1−ᾱ)·x_0 (Salimans & Ho 2022). v's x_0 error stays bounded at t ≈ T,
    where ε's is amplified by √((1−ᾱ)/ᾱ) (~150x at T for the linear schedule)."""
    if prediction_type == "v_prediction":
        return a_bar.sqrt() * eps - (1 - a_bar).sqrt() * x0
    return eps


def predicted_x0(
    x_t: torch.Tensor, pred: torch.Tensor, a_bar: torch.Tensor, prediction_type: str
) -> torch.Tensor:
    """The clean image a prediction implies: √ᾱ·x_t − √(1−ᾱ)·v̂, or (x_t − √(1−ᾱ)·ε̂)/√ᾱ."""
    if prediction_type == "v_prediction":
        return a_bar.sqrt() * x_t - (1 - a_bar).sqrt() * pred
    return (x_t - (1 - a_bar).sqrt() * pred) / a_bar.sqrt()


def denoising_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    snr: torch.Tensor,
    gamma: float,
    prediction_type: str = "epsilon",
) -> torch.Tensor:
    """‖target − pred‖², per sample weighted by Min-SNR-γ when γ > 0 (Hang et al. 2023: the
    easy, low-noise steps stop dominating the gradient). Both weightings equal min(SNR, γ) on
    the x_0 error: min(SNR, γ)/SNR for ε, min(SNR, γ)/(SNR + 1) for v. γ = 0: the plain mean."""
    if gamma <= 0:
        return F.mse_loss(pred, target)
    per_sample = (pred - target).pow(2).flatten(1).mean(1)
    denominator = snr + 1 if prediction_type == "v_prediction" else snr
    return (per_sample * snr.clamp(max=gamma) / denominator).mean()
