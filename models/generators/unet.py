"""`unet` backend: class-conditional pixel diffusion with diffusers' ``UNet2DModel``.

Closest to the original CSM (class-conditional EDM at 32×32): the class enters through the table
``unet.class_embedding`` (``num_class_embeds = C``) and is mixed as α·E[a] + (1−α)·E[b] (k-way:
Σ_i w_i·E[c_i]). To mix without touching diffusers' forward, the table is replaced by a
``MixableEmbedding`` that takes class-weight vectors as ``class_labels``.

Classifier-free guidance (Ho & Salimans 2022): a UNet trained with label dropout has one more row,
the null condition ∅ (index C; the model's config says so: ``NULL_CLASS``). Sampling with guidance w evaluates the
denoiser under the series' mixed condition and under ∅ with the same x_t, in one batch, and uses
ε = ε(x_t, ∅) + w·(ε(x_t, c) − ε(x_t, ∅)); w = 1 is the plain conditional model, sampled exactly
as without guidance.

A trained model is a folder written by ``save_unet``: ``unet/`` (``save_pretrained``, safetensors)
and ``scheduler/`` (the training scheduler's config, from which the sampler is derived).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Unpack

import torch
from diffusers import DDIMScheduler, UNet2DModel
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from .base import Generator, MixableEmbedding, Shared, make_mixable, mix_weights
from .loading import dtype_kwarg, load_pretrained
from .schedulers import make_scheduler
from .unet_presets import UNET_PRESETS

NULL_CLASS = "_semix_null_class"  # in the UNet's config: the table's last row is ∅ (diffusers
# keeps "_" keys in config.json and passes none of them to __init__)


def build_unet(
    image_size: int,
    num_classes: int,
    channels: tuple[int, ...] = (32, 64, 64),
    attention: tuple[bool, ...] = (False, True, False),
    layers_per_block: int = 1,
    dropout: float = 0.0,
    attention_head_dim: int = 8,
    null_class: bool = False,
) -> UNet2DModel:
    """A random-weight class-conditional RGB ``UNet2DModel`` (one level per entry of ``channels``);
    ``null_class`` adds the row ∅ of classifier-free guidance after the ``num_classes`` rows."""
    if len(attention) != len(channels):
        raise ValueError(f"attention has {len(attention)} levels, channels {len(channels)}")
    down = tuple("AttnDownBlock2D" if at else "DownBlock2D" for at in attention)
    up = tuple("AttnUpBlock2D" if at else "UpBlock2D" for at in reversed(attention))
    unet = UNet2DModel(
        sample_size=image_size,
        in_channels=3,
        out_channels=3,
        block_out_channels=tuple(channels),
        down_block_types=down,
        up_block_types=up,
        layers_per_block=layers_per_block,
        num_class_embeds=num_classes + int(null_class),
        norm_num_groups=math.gcd(32, *channels),  # GroupNorm needs groups dividing every width
        attention_head_dim=attention_head_dim,
        dropout=dropout,
    )
    if null_class:
        unet.register_to_config(**{NULL_CLASS: True})
    return unet


def unet_from_preset(preset: str, num_classes: int, null_class: bool = False) -> UNet2DModel:
    if preset not in UNET_PRESETS:
        raise ValueError(f"unknown unet preset {preset!r}; choose one of {sorted(UNET_PRESETS)}")
    p = UNET_PRESETS[preset]
    return build_unet(
        p.image_size, num_classes, p.block_out_channels, p.attention, p.layers_per_block,
        p.dropout, null_class=null_class,
    )  # fmt: skip


def save_unet(folder: str | Path, unet: UNet2DModel, scheduler: SchedulerMixin) -> None:
    """Write ``folder/unet`` (weights + config) and ``folder/scheduler`` (training noise schedule)."""
    unet.save_pretrained(Path(folder) / "unet")
    scheduler.save_pretrained(Path(folder) / "scheduler")


def load_unet(
    folder: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[UNet2DModel, dict[str, Any]]:
    """Inverse of ``save_unet``: the UNet (in ``dtype``) and its scheduler config (a dict)."""
    unet = load_pretrained(
        UNet2DModel.from_pretrained, folder, subfolder="unet", **dtype_kwarg(dtype)
    )
    config = load_pretrained(DDIMScheduler.load_config, folder, subfolder="scheduler")
    return unet, config


class UNetGenerator(Generator):
    """CSM series from a class-conditional pixel UNet.

    ``revision`` names the weights (fit-generator's manifest records their sha256; the generate
    stage passes it) and goes into ``metadata()``. ``guidance`` w ≠ 1 needs a UNet with the null
    condition (fitted with ``label_dropout`` > 0); any other is refused when it loads.
    """

    backend = "unet"

    def __init__(
        self,
        model: str | Path,
        *,
        guidance: float = 1.0,
        clip_sample: bool | None = None,
        lazy: bool = False,
        **shared: Unpack[Shared],
    ) -> None:
        if guidance < 0:
            raise ValueError(f"guidance must be >= 0, got {guidance}")
        super().__init__(model, **shared)
        self.guidance = float(guidance)
        # Lin et al. (2024) §3.4: the guided prediction's std pulled back towards the conditional
        # one's by this fraction; 0 = plain guidance (bench/bench_levers.py measures it)
        self.guidance_rescale = 0.0
        # DDIM's x̂₀ clipping: None = the saved scheduler config's (clip_sample); True / False
        # override it (fit-generator chooses it like w, per call: stages/common/fidelity.py)
        self.clip_sample = clip_sample
        if not lazy:
            self.load()

    @classmethod
    def from_model(
        cls, unet: UNet2DModel, scheduler_config: Any, *, model: str = "in-memory", **kwargs: Any
    ) -> UNetGenerator:
        """A generator around a UNet already in memory (fit-generator's EMA weights, checked for
        fidelity while it trains); ``kwargs`` as the constructor's."""
        gen = cls(model, lazy=True, **kwargs)
        gen._setup(unet, scheduler_config)
        gen._loaded = True
        return gen

    @property
    def model_id(self) -> str:
        """folder/ as <its parent>/<its name>: fit-generator always writes runs/<classes>/generator,
        so the parent is what tells two of them apart."""
        path = Path(self.model)
        return f"{path.parent.name}/{path.name}"

    def _load(self) -> None:
        self._setup(*load_unet(self.model, self.dtype))

    def _setup(self, unet: UNet2DModel, config: Any) -> None:
        if unet.class_embedding is None or unet.config.class_embed_type is not None:
            raise ValueError(
                f"{self.model}: the UNet has no class-embedding table (num_class_embeds)"
            )
        self.null_class = bool(unet.config.get(NULL_CLASS, False))
        self._check_guidance(self.guidance)
        if not isinstance(unet.class_embedding, MixableEmbedding):
            make_mixable(unet, "class_embedding")
        self.num_embeds = int(unet.config.num_class_embeds)  # C, or C + 1 with the null row
        self.num_classes = self.num_embeds - int(self.null_class)
        size = unet.config.sample_size
        self.image_size = int(size if isinstance(size, int) else size[0])
        self.scheduler_config = config
        self.scheduler = self._scheduler(self.clip_sample)
        self.unet = unet.to(self.device).eval()  # SDPA attention by default
        self._forward = torch.compile(self.unet) if self.torch_compile else self.unet

    def _check_guidance(self, w: float) -> float:
        """w, if this UNet can be sampled at it: w ≠ 1 needs the null condition."""
        if w != 1.0 and not self.null_class:
            raise ValueError(
                f"guidance={w:g}: {self.model} has no null condition (fitted without "
                "label dropout); refit it with fit-generator label_dropout=0.1, or use guidance=1"
            )
        return w

    def _scheduler(self, clip_sample: bool | None) -> Any:
        """A new sampler from the saved config, with x̂₀ clipping on / off (None: the config's)."""
        config = self.scheduler_config
        if clip_sample is not None:
            config = {**dict(config), "clip_sample": clip_sample}
        return make_scheduler(self.sampler, config)

    def call_settings(self, guidance: float | None, clip_sample: bool | None) -> dict[str, Any]:
        """A call's w (checked against the null condition) and, for a call's own x̂₀ clipping, a
        sampler of its own built for the call: ``self.scheduler`` is never replaced."""
        settings: dict[str, Any] = {}
        if guidance is not None:
            if guidance < 0:
                raise ValueError(f"guidance must be >= 0, got {guidance}")
            settings["guidance"] = self._check_guidance(float(guidance))
        if clip_sample is not None:
            settings["scheduler"] = self._scheduler(bool(clip_sample))
        return settings

    def metadata(self) -> dict[str, Any]:
        meta = super().metadata()
        if self.clip_sample is not None:  # recorded only when chosen (docs/compat.md)
            meta["clip_sample"] = self.clip_sample
        return meta

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return (self.unet.config.in_channels, self.image_size, self.image_size)

    def condition(self, classes: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Class weights Σ_i w_i·e_{c_i} (k = 2: α·e_a + (1−α)·e_b) over the table's rows (the
        null row, if any, gets 0); the table turns them into Σ_i w_i·E[c_i]."""
        return mix_weights(classes, weights, self.num_embeds)

    def null_condition(self, cond: torch.Tensor) -> torch.Tensor:
        """∅ for every row of ``cond`` (integer labels [B] or class weights [B, N])."""
        null = self.num_embeds - 1
        if cond.is_floating_point():
            return torch.nn.functional.one_hot(
                torch.full(cond.shape[:1], null, device=cond.device), self.num_embeds
            ).to(cond.dtype)
        return torch.full_like(cond, null)

    def sample(
        self,
        noise: torch.Tensor,
        cond: torch.Tensor,
        guidance: float | None = None,
        scheduler: Any = None,
    ) -> torch.Tensor:
        """Deterministic reverse process; ``cond`` is integer labels [B] or class weights [B, N].
        With guidance w ≠ 1 each step is one batch of 2B rows: [x_t; x_t] under [c; ∅].
        ``guidance``, ``scheduler``: the call's (``call_settings``); None: the generator's own."""
        w = self.guidance if guidance is None else guidance
        sched = self.scheduler if scheduler is None else scheduler
        sched.set_timesteps(self.steps, device=self.device)
        x = noise * sched.init_noise_sigma
        guided = w != 1.0
        if guided:
            cond = torch.cat([cond, self.null_condition(cond)])
        for t in sched.timesteps:
            x_in = sched.scale_model_input(x, t)
            if guided:
                x_in = torch.cat([x_in, x_in])
            eps = self._forward(x_in, t, class_labels=cond).sample
            if guided:
                eps_c, eps_null = eps.chunk(2)
                eps = eps_null + w * (eps_c - eps_null)
                if self.guidance_rescale:
                    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import (
                        rescale_noise_cfg,
                    )

                    eps = rescale_noise_cfg(eps, eps_c, self.guidance_rescale)
            x = sched.step(eps, t, x).prev_sample
        return x
