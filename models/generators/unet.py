"""`unet` backend: class-conditional pixel diffusion with diffusers' ``UNet2DModel``.

Closest to the original CSM (class-conditional EDM at 32×32, METHODS §1): the class enters through
the table ``unet.class_embedding`` (``num_class_embeds = C``) and is mixed as α·E[a] + (1−α)·E[b] (k-way: Σ_i w_i·E[c_i]).
To mix without touching diffusers' forward, the table is replaced by a ``MixableEmbedding`` that
takes class-weight vectors as ``class_labels``.

A trained model is a folder written by ``save_unet``: ``unet/`` (``save_pretrained``, safetensors)
and ``scheduler/`` (the training scheduler's config, from which the sampler is derived).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import DDIMScheduler, UNet2DModel
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from .base import Generator, load_pretrained, make_mixable, make_scheduler, mix_weights


@dataclass(frozen=True)
class UNetPreset:
    """Architecture of a class-conditional pixel UNet; ``attention[i]``: self-attention at level i."""

    image_size: int
    block_out_channels: tuple[int, ...]
    attention: tuple[bool, ...]
    layers_per_block: int
    dropout: float = 0.0


UNET_PRESETS: dict[str, UNetPreset] = {
    # ~1.1 M parameters: trains on the 2-core machine in minutes (NOTES.md speed figures).
    "digits-tiny": UNetPreset(16, (32, 64, 64), (False, True, False), layers_per_block=1),
    # Fashion-MNIST at its native 28x28 (28 -> 14 -> 7): the digits widths, attention only at 7x7
    # (49 tokens; at 14x14 it costs 40 % more per step on 2 CPU cores): ~1.7 s per step at batch
    # 128 on the 2-core machine.
    "fashion-28": UNetPreset(28, (32, 64, 64), (False, False, True), layers_per_block=1),
    # EDM DDPM++ CIFAR capacity (~56 M there, ~59 M here): 128·(2, 2, 2) channels, 4 blocks per
    # level, attention at 16×16, dropout 0.13.
    "cifar": UNetPreset(
        32, (256, 256, 256), (False, True, False), layers_per_block=4, dropout=0.13
    ),
}


def build_unet(
    image_size: int,
    num_classes: int,
    channels: tuple[int, ...] = (32, 64, 64),
    attention: tuple[bool, ...] = (False, True, False),
    layers_per_block: int = 1,
    dropout: float = 0.0,
    attention_head_dim: int = 8,
) -> UNet2DModel:
    """A random-weight class-conditional RGB ``UNet2DModel`` (one level per entry of ``channels``)."""
    if len(attention) != len(channels):
        raise ValueError(f"attention has {len(attention)} levels, channels {len(channels)}")
    down = tuple("AttnDownBlock2D" if at else "DownBlock2D" for at in attention)
    up = tuple("AttnUpBlock2D" if at else "UpBlock2D" for at in reversed(attention))
    return UNet2DModel(
        sample_size=image_size,
        in_channels=3,
        out_channels=3,
        block_out_channels=tuple(channels),
        down_block_types=down,
        up_block_types=up,
        layers_per_block=layers_per_block,
        num_class_embeds=num_classes,
        norm_num_groups=math.gcd(32, *channels),  # GroupNorm needs groups dividing every width
        attention_head_dim=attention_head_dim,
        dropout=dropout,
    )


def unet_from_preset(preset: str, num_classes: int) -> UNet2DModel:
    if preset not in UNET_PRESETS:
        raise ValueError(f"unknown unet preset {preset!r}; choose one of {sorted(UNET_PRESETS)}")
    p = UNET_PRESETS[preset]
    return build_unet(
        p.image_size, num_classes, p.block_out_channels, p.attention, p.layers_per_block, p.dropout
    )


def save_unet(folder: str | Path, unet: UNet2DModel, scheduler: SchedulerMixin) -> None:
    """Write ``folder/unet`` (weights + config) and ``folder/scheduler`` (training noise schedule)."""
    unet.save_pretrained(Path(folder) / "unet")
    scheduler.save_pretrained(Path(folder) / "scheduler")


def load_unet(
    folder: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[UNet2DModel, dict[str, Any]]:
    """Inverse of ``save_unet``: the UNet (in ``dtype``) and its scheduler config (a dict)."""
    unet = load_pretrained(UNet2DModel.from_pretrained, folder, subfolder="unet", torch_dtype=dtype)
    config = load_pretrained(DDIMScheduler.load_config, folder, subfolder="scheduler")
    return unet, config


class UNetGenerator(Generator):
    """CSM series from a class-conditional pixel UNet; no guidance (as CSM: 1.0).

    ``revision`` names the weights (fit-generator's manifest records their sha256; the generate
    stage passes it) and goes into ``metadata()``.
    """

    backend = "unet"

    def __init__(
        self,
        model: str | Path,
        *,
        revision: str | None = None,
        sampler: str = "ddim",
        steps: int = 25,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        batch_size: int = 64,
        row_multiple: int = 8,
        torch_compile: bool = False,
        lazy: bool = False,
    ) -> None:
        super().__init__(
            model=model,
            revision=revision,
            sampler=sampler,
            steps=steps,
            device=device,
            dtype=dtype,
            batch_size=batch_size,
            row_multiple=row_multiple,
        )
        self.guidance, self.torch_compile = 1.0, torch_compile
        if not lazy:
            self.load()

    @property
    def model_id(self) -> str:
        """folder/ as <its parent>/<its name>: fit-generator always writes runs/<classes>/generator,
        so the parent is what tells two of them apart."""
        path = Path(self.model)
        return f"{path.parent.name}/{path.name}"

    def _load(self) -> None:
        unet, config = load_unet(self.model, self.dtype)
        if unet.class_embedding is None or unet.config.class_embed_type is not None:
            raise ValueError(
                f"{self.model}: the UNet has no class-embedding table (num_class_embeds)"
            )
        make_mixable(unet, "class_embedding")
        self.num_classes = int(unet.config.num_class_embeds)
        size = unet.config.sample_size
        self.image_size = int(size if isinstance(size, int) else size[0])
        self.scheduler = make_scheduler(self.sampler, config)
        self.unet = unet.to(self.device).eval()  # SDPA attention by default
        self._forward = torch.compile(self.unet) if self.torch_compile else self.unet

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return (self.unet.config.in_channels, self.image_size, self.image_size)

    def condition(self, classes: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Class weights Σ_i w_i·e_{c_i} (k = 2: α·e_a + (1−α)·e_b); the table turns them into
        Σ_i w_i·E[c_i]."""
        return mix_weights(classes, weights, self.num_classes)

    def sample(self, noise: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Deterministic reverse process; ``cond`` is integer labels [B] or class weights [B, C]."""
        sched = self.scheduler
        sched.set_timesteps(self.steps, device=self.device)
        x = noise * sched.init_noise_sigma
        for t in sched.timesteps:
            eps = self._forward(sched.scale_model_input(x, t), t, class_labels=cond).sample
            x = sched.step(eps, t, x).prev_sample
        return x
