"""Config of the `fit-generator` stage: real/train -> runs/<classes>/generator/ (unet backend)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from core.config import (
    ConfigError,
    StageConfig,
    check_choice,
    check_range,
    not_recorded,
    recorded_off_default,
)
from core.precision import check_precision
from core.tracking import parse_trackers
from core.tree import section
from models.generators import UNET_PRESETS
from models.generators.objective import PREDICTION_TYPES
from stages.configs.legacy import legacy_names
from stages.configs.sections import Checkpoint as SharedCheckpoint
from stages.presets import stage_presets

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")


@dataclass(frozen=True)
class Optim:
    """AdamW, linear warm-up, then lr_schedule; the EMA weights are what is saved"""

    lr: float = 2e-3
    warmup_steps: int = 50
    lr_schedule: str = "constant"  # constant | cosine (to 10 % of lr at the last step)
    weight_decay: float = 0.0
    clip_norm: float = 1.0  # max gradient norm; 0 = off
    ema_decay: float = 0.995
    min_snr_gamma: float = 0.0  # Min-SNR-γ loss weighting (Hang et al. 2023, γ = 5); 0 = off

    def __post_init__(self) -> None:
        check_choice("optim.lr_schedule", self.lr_schedule, ("constant", "cosine"))
        check_range("optim.min_snr_gamma", self.min_snr_gamma, 0.0)
        check_range("optim.warmup_steps", self.warmup_steps, 0)
        check_range("optim.lr", self.lr, 0.0)
        check_range("optim.ema_decay", self.ema_decay, 0.0, 1.0)
        check_range("optim.clip_norm", self.clip_norm, 0.0)


@dataclass(frozen=True)
class Noise:
    """the DDPM noise schedule and what the UNet predicts"""

    # what the UNet predicts: epsilon (the noise) | v_prediction (v = √ᾱ·ε − √(1−ᾱ)·x_0, whose
    # x_0 error stays bounded at high noise, where class shape is decided); recorded in scheduler/
    # (recorded off its default only: fits from before the field keep their config.json)
    prediction_type: str = recorded_off_default("epsilon")
    num_train_timesteps: int = 1000
    beta_schedule: str = "linear"  # DDPM betas 1e-4..0.02
    # rescale the betas so the last step is pure noise, ᾱ_T = 0 (Lin et al., 2024; diffusers'
    # rescale_betas_zero_snr): with "trailing" spacing the sampler then starts from what training
    # saw at t = T − 1; needs v_prediction (ε is undefined where the image has no signal)
    zero_terminal_snr: bool = recorded_off_default(False)

    def __post_init__(self) -> None:
        check_choice("noise.beta_schedule", self.beta_schedule, BETA_SCHEDULES)
        check_choice("noise.prediction_type", self.prediction_type, PREDICTION_TYPES)
        check_range("noise.num_train_timesteps", self.num_train_timesteps, 1)
        if self.zero_terminal_snr and self.prediction_type != "v_prediction":
            raise ConfigError(
                "noise.zero_terminal_snr=true needs noise.prediction_type=v_prediction: at "
                "ᾱ_T = 0 the image has no signal left, and ε-prediction cannot recover x_0 from it"
            )


@dataclass(frozen=True)
class Augment:
    """training augmentation"""

    flip: bool = False  # random horizontal flips (never for digits: a flipped 3 is no digit)


def parse_sampler_cell(entry: str) -> tuple[str, int, str]:
    """fidelity.samplers' "<sampler>:<steps>[:bf16]" -> (sampler, steps, precision "fp32" |
    "bf16"); a malformed entry is refused in one line with the form."""
    from models.generators.schedulers import SAMPLERS

    parts = entry.split(":")
    ok = len(parts) in (2, 3) and parts[0] in SAMPLERS and parts[1].isdigit() and int(parts[1]) > 0
    if not ok or (len(parts) == 3 and parts[2] != "bf16"):
        raise ConfigError(
            f"fidelity.samplers entry {entry!r} is not <sampler>:<steps>[:bf16] with a sampler "
            f"of {', '.join(SAMPLERS)}, e.g. unipc:12 or dpmsolver++:12:bf16"
        )
    return parts[0], int(parts[1]), parts[2] if len(parts) == 3 else "fp32"


@dataclass(frozen=True)
class Fidelity:
    """endpoint fidelity while fitting: it chooses the generator's guidance"""

    # pure-class images from a fixed noise, for every guidance w in guidance_grid, judged by the
    # real-only classifier train/<judge> (a CNN; "" = none) and a linear probe on the pixels of
    # the same train_limit images; the best w by the judge (else the probe) becomes the
    # generator's recorded guidance. The chooser shapes the generator: its labelled images
    # count in the generator's budget (stages/common/budget.py)
    judge: str = ""
    # more real-only runs train/<run> that only report fidelity beside the chooser (a judge
    # trained on more labels than the study's budget belongs here); not part of the identity
    report_judges: tuple[str, ...] = not_recorded(())
    guidance_grid: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0)
    # also check every w with DDIM's x̂₀ clipping flipped (the scheduler's clip_sample on / off)
    # and choose the pair (w, clipping) by the same judge; generate samples with the choice
    clip_choice: bool = recorded_off_default(False)
    # faster sampler cells judged beside the fit's own (DDIM at preview.sample_steps), each at
    # every w (and clipping) of the grid: "<sampler>:<steps>" or "<sampler>:<steps>:bf16" (bf16
    # weights, checked only where the device computes bf16 natively); the study chooses among
    # them like w and clipping (pipeline/study/cells.py); they never change the recorded w
    samplers: tuple[str, ...] = recorded_off_default(())
    every: int = 0  # check every N steps too (0 = only at the end)
    per_class: int = 20  # endpoint images per class and w

    def __post_init__(self) -> None:
        for entry in self.samplers:
            parse_sampler_cell(entry)
        check_range("fidelity.every", self.every, 0)
        check_range("fidelity.per_class", self.per_class, 1)
        if not self.guidance_grid or min(self.guidance_grid) < 0:
            raise ConfigError(
                f"fidelity.guidance_grid={self.guidance_grid}: give weights w >= 0, e.g. 1,2"
            )
        if self.judge and self.judge in self.report_judges:
            raise ConfigError(
                f"fidelity.report_judges names fidelity.judge={self.judge!r}: it chooses "
                "already; fidelity.report_judges= lists the others"
            )


@dataclass(frozen=True)
class Checkpoint(SharedCheckpoint):
    """how often checkpoints are written, how many are kept and how a fit continues"""

    every: int = 100  # a checkpoint every N steps (and at the end)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("checkpoint.every", self.every, 1)


@dataclass(frozen=True)
class Preview:
    """sample_grid.png"""

    per_class: int = 8  # columns of sample_grid.png (one row per class)
    sample_steps: int = 25  # DDIM steps for sample_grid.png

    def __post_init__(self) -> None:
        check_range("preview.per_class", self.per_class, 1)
        check_range("preview.sample_steps", self.sample_steps, 1)


@dataclass(frozen=True)
class Config(StageConfig):
    # the folders under the runs root it names: plain names (core.config.check_plain_name)
    FOLDER_NAMES: ClassVar[tuple[str, ...]] = ("name", "fidelity.judge", "fidelity.report_judges")
    LEGACY = legacy_names("fit-generator")

    unet: str = "digits-tiny"  # architecture: a name in models.generators.UNET_PRESETS
    train_steps: int = 500  # optimiser steps
    batch_size: int = 128  # images per step and process
    optim: Optim = section(Optim)
    noise: Noise = section(Noise)
    augment: Augment = section(Augment)
    # auto | fp32 | bf16 | fp16 (core/precision.py; `no` = fp32): accelerate's autocast; auto =
    # bf16 where the device computes it natively, CPUs with AVX512-BF16 or AMX included
    precision: str = "auto"
    # classifier-free guidance: share of training labels replaced by the null condition (an
    # extra class-table row); 0 = no null condition, and generate can only use guidance 1
    label_dropout: float = 0.1
    train_limit: int = 0  # fit on the first N training images only (as train's); 0 = all
    fidelity: Fidelity = section(Fidelity)
    checkpoint: Checkpoint = section(Checkpoint)
    preview: Preview = section(Preview)
    log_every: int = 50  # log the mean loss every N steps
    device: str = ""  # "" = accelerate's choice (GPU if any); "cpu" forces the CPU
    # experiment tracking (core/tracking.py): none | tensorboard | wandb | mlflow | trackio, or
    # several (tensorboard,mlflow): loss, lr and the fidelity points; not part of the identity
    tracker: str = not_recorded("none")

    @property
    def checked_guidance_grid(self) -> tuple[float, ...]:
        """fidelity.guidance_grid as the check samples it: each w once, increasing; without a null
        condition only w = 1 exists. Not `guidance_grid`: that is the leaf's flat name
        (config.json's, LEGACY), and a config answers no flat name."""
        grid = self.fidelity.guidance_grid
        return tuple(sorted(set(grid))) if self.label_dropout > 0 else (1.0,)

    def __post_init__(self):
        check_choice("unet", self.unet, sorted(UNET_PRESETS))
        check_precision("precision", self.precision)
        check_choice("device", self.device, ("", "cpu"))
        for name in ("train_steps", "batch_size", "log_every"):
            check_range(name, getattr(self, name), 1)
        check_range("label_dropout", self.label_dropout, 0.0, 0.5)
        check_range("train_limit", self.train_limit, 0)
        parse_trackers(self.tracker)


PRESETS = stage_presets("fit-generator")
