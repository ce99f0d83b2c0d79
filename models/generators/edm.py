"""`edm` backend: the paper's own generators, class-conditional EDM pixel networks (docs/methods.md §1).

CSM sampled the class-conditional EDM "cond-vp" networks (CIFAR-10/100 32×32, Tiny-ImageNet 64×64)
with EDM's deterministic 2nd-order Heun sampler: σ from 80 down to 0.002 on the ρ = 7 schedule,
no churn, no guidance, 20 (CIFAR-10) or 25 (CIFAR-100, Tiny-ImageNet) steps; the mix enters the
label-embedding layer as y = α·onehot(a) + (1−α)·onehot(b).

``model`` is a folder written by ``convert_edm_pickle`` (``python -m pipeline convert-edm``:
safetensors + config, read with ``EDMNetwork.from_pretrained``) or an EDM ``.pkl`` itself, read by
the restricted unpickler of ``edm_pickle`` (nothing in it is executed).

The sampler (Karras et al. 2022, Algorithm 1 with S_churn = 0): t_i = (σ_max^(1/ρ) + i/(N−1)·
(σ_min^(1/ρ) − σ_max^(1/ρ)))^ρ for i < N, t_N = 0; x_0 = z·t_0; per step the Euler update
x' = x + (t_{i+1} − t_i)·d(x, t_i) with d = (x − D(x; t))/t, then (Heun, only when t_{i+1} > 0) the
trapezoidal correction x' = x + (t_{i+1} − t_i)·(d(x, t_i) + d(x', t_{i+1}))/2. So N steps cost
2N − 1 network calls, the last step being plain Euler into σ = 0.

The σ schedule is diffusers' ``EDMEulerScheduler`` (Karras sigmas, final σ 0): the same formula,
tested against the closed form. Its ``step()`` is not used: it is Euler only, and it rebuilds x̂₀
from the raw network output with EDM-preconditioning coefficients (the VP networks have their own);
``HeunDiscreteScheduler`` maps σ onto the discrete timesteps of a β schedule, so its σ range and
network inputs are not EDM's. The update is therefore written out below, in float64 like EDM's own
sampler (its Euler part is tested equal to ``EDMEulerScheduler.step``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Unpack

import torch
from diffusers import EDMEulerScheduler

from .base import Generator, Shared, mix_weights
from .edm_net import EDMNetwork
from .edm_pickle import load_edm_pickle
from .loading import ModelNotFoundError, dtype_kwarg, load_pretrained
from .registry import EDM_SAMPLERS


def load_edm(model: str | Path, dtype: torch.dtype = torch.float32) -> EDMNetwork:
    """An ``EDMNetwork`` from a converted folder, an EDM ``.pkl`` (restricted read) or a hub id."""
    path = Path(model)
    if path.is_file():
        return load_edm_pickle(path, dtype)
    if not path.is_dir() and path.suffix == ".pkl":
        raise ModelNotFoundError(f"EDM network {model} not found (no such file)")
    return load_pretrained(EDMNetwork.from_pretrained, model, **dtype_kwarg(dtype)).eval()


def karras_sigmas(steps: int, sigma_min: float, sigma_max: float, rho: float) -> list[float]:
    """t_0 > ... > t_{N−1}, then t_N = 0 (EDM eq. 5), from diffusers' ``EDMEulerScheduler``."""
    sched = EDMEulerScheduler(
        sigma_min=sigma_min,
        sigma_max=sigma_max,
        rho=rho,
        sigma_schedule="karras",
        final_sigmas_type="zero",
    )
    sched.set_timesteps(steps)
    return sched.sigmas.tolist()


class EDMGenerator(Generator):
    """CSM series from a class-conditional EDM network; no guidance (as CSM: 1.0): a call at
    another w is refused (``Generator.call_settings``)."""

    backend = "edm"
    samplers = EDM_SAMPLERS  # heun first: the default
    default_steps = 18

    def __init__(
        self,
        model: str | Path,
        *,
        num_classes: int | None = None,
        image_size: int | None = None,
        sigma_min: float = 0.002,
        sigma_max: float = 80.0,
        rho: float = 7.0,
        lazy: bool = False,
        **shared: Unpack[Shared],
    ) -> None:
        super().__init__(model, **shared)
        self.guidance = 1.0
        self.dataset_classes, self.dataset_size = num_classes, image_size  # checked on load
        self.sigma_min, self.sigma_max, self.rho = sigma_min, sigma_max, rho
        if not lazy:
            self.load()

    def _load(self) -> None:
        net = load_edm(self.model, self.dtype)
        cfg = net.config
        if not cfg.label_dim:
            raise ValueError(f"{self.model}: an unconditional EDM network cannot mix classes")
        if self.dataset_classes is not None and cfg.label_dim != self.dataset_classes:
            raise ValueError(
                f"{self.model}: the EDM network knows {cfg.label_dim} classes, the dataset has "
                f"{self.dataset_classes}"
            )
        self.net = net.to(self.device).eval()
        self.num_classes = int(cfg.label_dim)
        self.image_size = int(self.dataset_size or cfg.img_resolution)
        # clip the schedule to the σ range the network was trained on (as EDM's sampler does)
        low, high = net.sigma_range
        self.sigmas = karras_sigmas(
            self.steps, max(self.sigma_min, low), min(self.sigma_max, high), self.rho
        )
        self._forward = torch.compile(self.net) if self.torch_compile else self.net

    @property
    def noise_shape(self) -> tuple[int, ...]:
        cfg = self.net.config
        return (cfg.img_channels, cfg.img_resolution, cfg.img_resolution)

    def condition(self, classes: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """y = Σ_i w_i·e_{c_i} (k = 2: α·e_a + (1−α)·e_b), the input of the label-embedding
        layer (a linear map)."""
        return mix_weights(classes, weights, self.num_classes)

    def _d(self, x: torch.Tensor, sigma: float, cond: torch.Tensor) -> torch.Tensor:
        """ODE direction d = (x − D(x; σ))/σ, in float64."""
        s = torch.full((len(x),), sigma, device=x.device, dtype=torch.float32)
        return (x - self._forward(x, s, cond).to(torch.float64)) / sigma

    def sample(self, noise: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Deterministic EDM sampling (Euler, or Heun with the 2nd-order correction)."""
        t = self.sigmas
        x = noise.to(torch.float64) * t[0]
        for i in range(len(t) - 1):
            d = self._d(x, t[i], cond)
            x_next = x + (t[i + 1] - t[i]) * d  # Euler step
            if self.sampler == "heun" and t[i + 1] > 0:  # 2nd-order correction (not into σ = 0)
                x_next = x + (t[i + 1] - t[i]) * (0.5 * d + 0.5 * self._d(x_next, t[i + 1], cond))
            x = x_next
        return x.to(torch.float32)
