"""`dit` backend: class-conditional DiT (``DiTPipeline``, ImageNet class ids).

docs/methods.md §1: every transformer block has its own adaLN-Zero class embedder
(``block.norm1.emb.class_embedder.embedding_table``); each table is made mixable, so class-weight
vectors w = α·e_a + (1−α)·e_b mix α·E[a] + (1−α)·E[b] in every block (and in the final layer, which
reuses block 0's embedder). The null class (row ``num_classes``, 1000 for ImageNet) serves
classifier-free guidance like ``DiTPipeline``: the batch is doubled with the null class and
eps = uncond + g·(cond − uncond). DiT's usual 4.0 must be chosen explicitly; CSM used none (1.0).

``DiTPipeline.__call__`` cannot take initial latents, so the short sampling loop is ours; it follows
the pipeline step by step (learned-σ channels are dropped, as the pipeline does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Unpack

import torch

from core.parts import Params, param

from .base import Generator, MixableEmbedding, Shared, make_mixable, mix_weights
from .loading import load_pipeline
from .schedulers import make_scheduler


class DiTGenerator(Generator):
    """CSM series from a DiT; ``class_ids[i]`` is the DiT (ImageNet) id of our class i."""

    backend = "dit"
    default_batch_size = 32

    @dataclass(frozen=True)
    class Params(Params):
        """dit's leaf of the generate config, `backend.dit.class_ids`; config.json records it as
        `dit_class_ids`."""

        class_ids: tuple[int, ...] = param(
            (), doc="dit: ImageNet id of each of our classes, in order"
        )

    def __init__(
        self,
        model: str | Path,
        class_ids: Sequence[int],
        *,
        guidance: float,
        image_size: int = 32,
        lazy: bool = False,
        **shared: Unpack[Shared],
    ) -> None:
        super().__init__(model, **shared)
        self.class_ids = torch.tensor(list(class_ids), device=self.device)
        self.num_classes = len(class_ids)
        self.guidance, self.image_size = float(guidance), int(image_size)
        if not lazy:
            self.load()

    def _load(self) -> None:
        pipe = load_pipeline("DiTPipeline", self.model, self.revision, self.dtype)
        self.transformer = pipe.transformer.to(self.device).eval()
        self.vae = pipe.vae.to(self.device).eval()
        self.scheduler = make_scheduler(self.sampler, pipe.scheduler.config)
        self._tables = [
            self._mixable_table(i, blk) for i, blk in enumerate(self.transformer.transformer_blocks)
        ]
        # table rows: the DiT classes, plus the null class if it was trained with label dropout
        self.null_id = self.transformer.transformer_blocks[0].norm1.emb.class_embedder.num_classes
        ids = self.class_ids.tolist()
        if any(not 0 <= c < self.null_id for c in ids):
            raise ValueError(f"class_ids must lie in [0, {self.null_id}), got {ids}")
        self._check_guidance(self.guidance)
        self._forward = torch.compile(self.transformer) if self.torch_compile else self.transformer

    @staticmethod
    def _mixable_table(i: int, block: torch.nn.Module) -> MixableEmbedding:
        emb = getattr(getattr(block, "norm1", None), "emb", None)
        if emb is None or not hasattr(emb, "class_embedder"):
            raise ValueError(
                f"transformer block {i} has no adaLN-Zero class embedder (norm_type ada_norm_zero)"
            )
        return make_mixable(emb.class_embedder, "embedding_table")

    def _check_guidance(self, w: float) -> float:
        """w, if this DiT can be sampled at it: w > 1 needs the null class's table row."""
        if w > 1 and self.null_id >= self._tables[0].num_embeddings:
            raise ValueError(
                f"{self.model}: guidance {w} needs a null class, this DiT has none; use 1.0"
            )
        return w

    def call_settings(self, guidance: float | None, clip_sample: bool | None) -> dict[str, Any]:
        """A call's w, checked as the generator's own is when it loads; no x̂₀ clipping."""
        super().call_settings(None, clip_sample)  # refuses a clipping
        return {} if guidance is None else {"guidance": self._check_guidance(float(guidance))}

    def metadata(self) -> dict:
        return super().metadata() | {"class_ids": self.class_ids.tolist()}

    @property
    def noise_shape(self) -> tuple[int, ...]:
        cfg = self.transformer.config
        return (cfg.in_channels, cfg.sample_size, cfg.sample_size)

    def condition(self, classes: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weights over the DiT table: Σ_i w_i·e_{id(c_i)} [B, n_ids] (k = 2: α·e_{id(a)} +
        (1−α)·e_{id(b)}), mixed in every block."""
        return mix_weights(self.class_ids[classes], weights, self._tables[0].num_embeddings)

    def sample(
        self, noise: torch.Tensor, cond: torch.Tensor, guidance: float | None = None
    ) -> torch.Tensor:
        """Deterministic reverse process (DiTPipeline's loop); ``cond``: labels [B] or weights [B, N];
        ``guidance``: the call's w (``call_settings``), None: the generator's own."""
        w = self.guidance if guidance is None else guidance
        # 1. Guidance doubles the batch with the null class, as DiTPipeline does
        guided = w > 1
        if guided:
            null = torch.full((len(cond),), self.null_id, device=self.device)
            if cond.is_floating_point():
                null = torch.nn.functional.one_hot(null, cond.shape[1]).to(cond.dtype)
            cond = torch.cat([cond, null])
        n_lat = self.transformer.config.in_channels
        learned_sigma = self.transformer.config.out_channels == 2 * n_lat
        # 2. Denoising loop
        sched = self.scheduler
        sched.set_timesteps(self.steps, device=self.device)
        x = noise * sched.init_noise_sigma
        for t in sched.timesteps:
            x_in = sched.scale_model_input(torch.cat([x, x]) if guided else x, t)
            out = self._forward(x_in, timestep=t[None].expand(len(x_in)), class_labels=cond).sample
            eps = out[:, :n_lat] if learned_sigma else out
            if guided:
                eps_cond, eps_uncond = eps.chunk(2)
                eps = eps_uncond + w * (eps_cond - eps_uncond)
            x = sched.step(eps, t, x).prev_sample
        # 3. Decode latents
        return self.vae.decode(1 / self.vae.config.scaling_factor * x).sample  # as DiTPipeline
