"""`sd` backend: any Stable-Diffusion-compatible model (SD 1.5, 2.x, Turbo; hub id or local folder).

docs/methods.md §1: prompt embeddings E(a), E(b) of "a photo of a {name}" come from the pipeline's own text
encoder (``encode_prompt``); the condition is α·E(a) + (1−α)·E(b) and classifier-free guidance is
uncond + g·(cond − uncond), done by the pipeline from ``prompt_embeds``/``negative_prompt_embeds``.
Images are generated at the model's native resolution and resized to the dataset resolution with
antialiasing. The safety checker is not loaded: it silently blacks images out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Unpack

import torch

from core.config import ConfigError
from core.parts import Params, param

from .base import Generator, Shared
from .loading import load_pipeline
from .schedulers import make_scheduler


class SDGenerator(Generator):
    """CSM series from a Stable Diffusion pipeline; ``class_names[i]`` is the name of class i."""

    backend = "sd"
    default_batch_size = 16

    @dataclass(frozen=True)
    class Params(Params):
        """sd's leaves of the generate config (`backend.sd.<param>`), recorded in config.json
        under the names given here."""

        prompt_template: str = param(
            "a photo of a {name}",
            field="prompt_template",
            doc="sd: a class's prompt; {name}: its name",
        )
        negative_prompt: str = param("", field="negative_prompt", doc="sd: the negative prompt")
        native_size: int = param(
            0,
            low=0,
            field="native_size",
            doc="sd: generation resolution; 0 = the model's own (512 for SD 1.5)",
        )

        @classmethod
        def check_values(cls, values: Mapping[str, Any], spell: Callable[[str], str]) -> None:
            """The template must name the class: else every class gets one prompt."""
            if "{name}" not in values["prompt_template"]:
                raise ConfigError(
                    f"{spell('prompt_template')} must contain '{{name}}', got "
                    f"{values['prompt_template']!r}"
                )

    def __init__(
        self,
        model: str | Path,
        class_names: Sequence[str],
        *,
        image_size: int = 32,
        prompt_template: str = "a photo of a {name}",
        negative_prompt: str = "",
        guidance: float = 7.5,
        native_size: int | None = None,  # None or 0: the model's own
        lazy: bool = False,
        **shared: Unpack[Shared],
    ) -> None:
        super().__init__(model, **shared)
        if "{name}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{name}}', got {prompt_template!r}")
        self.class_names = list(class_names)
        self.num_classes = len(self.class_names)
        self.prompt_template, self.negative_prompt = prompt_template, negative_prompt
        self.guidance, self.image_size = float(guidance), int(image_size)
        self.native_size = native_size
        self._embeds: dict[int, torch.Tensor] = {}  # class index -> E(class) [T, D], float32
        self._uncond: torch.Tensor | None = None
        if not lazy:
            self.load()

    def _load(self) -> None:
        pipe = load_pipeline(
            "StableDiffusionPipeline",
            self.model,
            self.revision,
            self.dtype,
            safety_checker=None,
            requires_safety_checker=False,
        )
        pipe.scheduler = make_scheduler(self.sampler, pipe.scheduler.config)
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe.to(self.device)  # diffusers attention uses SDPA by default
        if self.torch_compile:
            self.pipe.unet = torch.compile(self.pipe.unet)
        size = self.native_size or pipe.unet.config.sample_size * pipe.vae_scale_factor
        self.native_size = int(size)

    def metadata(self) -> dict:
        return super().metadata() | {
            "prompt_template": self.prompt_template,
            "negative_prompt": self.negative_prompt,
        }

    @property
    def noise_shape(self) -> tuple[int, ...]:
        f = self.pipe.vae_scale_factor
        return (self.pipe.unet.config.in_channels, self.native_size // f, self.native_size // f)

    def prompt(self, c: int) -> str:
        return self.prompt_template.format(name=self.class_names[c])

    def _encode(self, c: int) -> torch.Tensor:
        """E(c), encoded once per class and alone (batch 1), so it never depends on a batch."""
        if c not in self._embeds:
            cond, uncond = self.pipe.encode_prompt(
                self.prompt(c), self.device, 1, True, negative_prompt=self.negative_prompt
            )
            self._embeds[c] = cond[0].float()
            if self._uncond is None:
                self._uncond = uncond[0]
        return self._embeds[c]

    def condition(self, classes: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Σ_i w_i·E(c_i) per row [B, T, D], summed left to right (k = 2: α·E(a) + (1−α)·E(b));
        mixed in float32, then cast."""
        w = weights.float()
        cond = None
        for i in range(classes.shape[1]):
            e_i = torch.stack([self._encode(c) for c in classes[:, i].tolist()])
            term = w[:, i, None, None] * e_i
            cond = term if cond is None else cond + term
        return cond.to(self.dtype)

    def call_settings(self, guidance: float | None, clip_sample: bool | None) -> dict[str, Any]:
        """A call's w (the pipeline's guidance_scale, any value: w ≤ 1 samples unguided); no
        x̂₀ clipping."""
        super().call_settings(None, clip_sample)  # refuses a clipping
        return {} if guidance is None else {"guidance": float(guidance)}

    def sample(
        self, noise: torch.Tensor, cond: torch.Tensor, guidance: float | None = None
    ) -> torch.Tensor:
        """Run the pipeline on shared ``latents``; decode ourselves to see non-finite values.
        ``guidance``: the call's w (``call_settings``); None: the generator's own."""
        latents = self.pipe(
            prompt_embeds=cond,
            negative_prompt_embeds=self._uncond.expand(len(cond), -1, -1),
            latents=noise,
            height=self.native_size,
            width=self.native_size,
            num_inference_steps=self.steps,
            guidance_scale=self.guidance if guidance is None else guidance,
            output_type="latent",
            return_dict=False,
        )[0]
        vae = self.pipe.vae
        return vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
