"""Config of the `fit-generator` stage: real/train -> runs/<classes>/generator/ (unet backend)."""

from __future__ import annotations

from dataclasses import dataclass

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
from models.generators import UNET_PRESETS
from models.generators.objective import PREDICTION_TYPES
from stages.presets import stage_presets

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")


@dataclass(frozen=True)
class Config(StageConfig):
    unet: str = "digits-tiny"  # architecture: a name in models.generators.UNET_PRESETS
    steps: int = 500  # optimiser steps
    batch_size: int = 128  # images per step and process
    lr: float = 2e-3  # AdamW, linear warm-up, then lr_schedule
    warmup_steps: int = 50
    lr_schedule: str = "constant"  # constant | cosine (to 10 % of lr at the last step)
    min_snr_gamma: float = 0.0  # Min-SNR-γ loss weighting (Hang et al. 2023, γ = 5); 0 = off
    # what the UNet predicts: epsilon (the noise) | v_prediction (v = √ᾱ·ε − √(1−ᾱ)·x_0, whose
    # x_0 error stays bounded at high noise, where class shape is decided); recorded in scheduler/
    # (recorded off its default only: fits from before the field keep their config.json)
    prediction_type: str = recorded_off_default("epsilon")
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max gradient norm; 0 = off
    ema_decay: float = 0.995  # the EMA weights are what is saved
    num_train_timesteps: int = 1000  # DDPM noise schedule
    beta_schedule: str = "linear"  # DDPM betas 1e-4..0.02
    # rescale the betas so the last step is pure noise, ᾱ_T = 0 (Lin et al., 2024; diffusers'
    # rescale_betas_zero_snr): with "trailing" spacing the sampler then starts from what training
    # saw at t = T − 1; needs v_prediction (ε is undefined where the image has no signal)
    zero_terminal_snr: bool = recorded_off_default(False)
    hflip: bool = False  # random horizontal flips (never for digits: a flipped 3 is no digit)
    # accelerate autocast: auto (bf16 on a CPU with native bf16 or a bf16 GPU, else fp32) | no |
    # bf16 | fp16 (GPU)
    # auto | fp32 | bf16 | fp16 (core/precision.py; `no` = fp32): auto = bf16 where the device
    # computes it natively, CPUs with AVX512-BF16 or AMX included (1.3x faster there)
    mixed_precision: str = "auto"
    # classifier-free guidance: share of training labels replaced by the null condition (an
    # extra class-table row); 0 = no null condition, and generate can only use guidance 1
    label_dropout: float = 0.1
    train_limit: int = 0  # fit on the first N training images only (as train's); 0 = all
    # endpoint fidelity while fitting: pure-class images from a fixed noise, for every guidance w
    # in guidance_grid, judged by the real-only classifier train/<judge_run> (a CNN; "" = none)
    # and a linear probe on the pixels of the same train_limit images; the best w by judge_run
    # (else the probe) becomes the generator's recorded guidance. The chooser shapes the
    # generator: its labelled images count in the generator's budget (shards/budget.py)
    judge_run: str = ""
    # more real-only runs train/<run> that only report fidelity beside the chooser (a judge
    # trained on more labels than the study's budget belongs here); not part of the identity
    report_judges: tuple[str, ...] = not_recorded(())
    guidance_grid: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0)
    # also check every w with DDIM's x̂₀ clipping flipped (the scheduler's clip_sample on / off)
    # and choose the pair (w, clipping) by the same judge; generate samples with the choice
    clip_choice: bool = recorded_off_default(False)
    fidelity_every: int = 0  # check every N steps too (0 = only at the end)
    fidelity_per_class: int = 20  # endpoint images per class and w
    checkpoint_every: int = 100  # a checkpoint every N steps (and at the end)
    checkpoints_total_limit: int = 2  # complete checkpoints kept
    # auto (newest complete, if any) | latest (must exist) | "" (start over) | a checkpoint
    # folder; not part of config.json
    resume: str = not_recorded("auto")
    samples_per_class: int = 8  # columns of sample_grid.png (one row per class)
    sample_steps: int = 25  # DDIM steps for sample_grid.png
    log_every: int = 50  # log the mean loss every N steps
    device: str = ""  # "" = accelerate's choice (GPU if any); "cpu" forces the CPU
    # experiment tracking (core/tracking.py): none | tensorboard | wandb | mlflow | trackio, or
    # several (tensorboard,mlflow): loss, lr and the fidelity points; not part of the identity
    tracker: str = not_recorded("none")

    @property
    def grid(self) -> tuple[float, ...]:
        """The guidance weights checked: without a null condition only w = 1 exists."""
        return tuple(sorted(set(self.guidance_grid))) if self.label_dropout > 0 else (1.0,)

    def __post_init__(self):
        check_choice("unet", self.unet, sorted(UNET_PRESETS))
        check_choice("beta_schedule", self.beta_schedule, BETA_SCHEDULES)
        check_precision("mixed_precision", self.mixed_precision)
        check_choice("lr_schedule", self.lr_schedule, ("constant", "cosine"))
        check_range("min_snr_gamma", self.min_snr_gamma, 0.0)
        check_choice("prediction_type", self.prediction_type, PREDICTION_TYPES)
        check_choice("device", self.device, ("", "cpu"))
        for name in ("steps", "batch_size", "checkpoint_every", "checkpoints_total_limit"):
            check_range(name, getattr(self, name), 1)
        for name in ("samples_per_class", "sample_steps", "log_every", "num_train_timesteps"):
            check_range(name, getattr(self, name), 1)
        check_range("warmup_steps", self.warmup_steps, 0)
        check_range("lr", self.lr, 0.0)
        check_range("ema_decay", self.ema_decay, 0.0, 1.0)
        check_range("grad_clip", self.grad_clip, 0.0)
        check_range("label_dropout", self.label_dropout, 0.0, 0.5)
        check_range("train_limit", self.train_limit, 0)
        check_range("fidelity_every", self.fidelity_every, 0)
        check_range("fidelity_per_class", self.fidelity_per_class, 1)
        parse_trackers(self.tracker)
        if not self.guidance_grid or min(self.guidance_grid) < 0:
            raise ConfigError(f"guidance_grid={self.guidance_grid}: give weights w >= 0, e.g. 1,2")
        if self.zero_terminal_snr and self.prediction_type != "v_prediction":
            raise ConfigError(
                "zero_terminal_snr=true needs prediction_type=v_prediction: at ᾱ_T = 0 the "
                "image has no signal left, and ε-prediction cannot recover x_0 from it"
            )
        if self.judge_run and self.judge_run in self.report_judges:
            raise ConfigError(
                f"report_judges names judge_run={self.judge_run!r}: it chooses already; "
                "report_judges= lists the others"
            )


PRESETS = stage_presets("fit-generator")
