"""Config of the `fit-generator` stage: real/train -> runs/<classes>/generator/ (unet backend)."""

from __future__ import annotations

from dataclasses import dataclass

from core.config import ConfigError, StageConfig, check_choice, check_range
from core.tracking import parse_trackers
from models.generators import UNET_PRESETS
from models.generators.objective import PREDICTION_TYPES

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
MIXED_PRECISION = ("auto", "no", "bf16", "fp16")  # auto: bf16 where the device has it, else no


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
    prediction_type: str = "epsilon"
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max gradient norm; 0 = off
    ema_decay: float = 0.995  # the EMA weights are what is saved
    num_train_timesteps: int = 1000  # DDPM noise schedule
    beta_schedule: str = "linear"  # DDPM betas 1e-4..0.02
    hflip: bool = False  # random horizontal flips (never for digits: a flipped 3 is no digit)
    # accelerate autocast: auto (bf16 on a CPU with native bf16 or a bf16 GPU, else fp32) | no |
    # bf16 | fp16 (GPU)
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
    report_judges: tuple[str, ...] = ()
    guidance_grid: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0)
    # also check every w with DDIM's x̂₀ clipping flipped (the scheduler's clip_sample on / off)
    # and choose the pair (w, clipping) by the same judge; generate samples with the choice
    clip_choice: bool = False
    fidelity_every: int = 0  # check every N steps too (0 = only at the end)
    fidelity_per_class: int = 20  # endpoint images per class and w
    checkpoint_every: int = 100  # a checkpoint every N steps (and at the end)
    checkpoints_total_limit: int = 2  # complete checkpoints kept
    # auto (newest complete, if any) | latest (must exist) | "" (start over) | a checkpoint
    # folder; not part of config.json
    resume: str = "auto"
    samples_per_class: int = 8  # columns of sample_grid.png (one row per class)
    sample_steps: int = 25  # DDIM steps for sample_grid.png
    log_every: int = 50  # log the mean loss every N steps
    device: str = ""  # "" = accelerate's choice (GPU if any); "cpu" forces the CPU
    # experiment tracking (core/tracking.py): none | tensorboard | wandb | mlflow | trackio, or
    # several (tensorboard,mlflow): loss, lr and the fidelity points; not part of the identity
    tracker: str = "none"

    def recorded(self) -> dict:
        """What the generator folder's config.json holds and a rerun is compared on: every
        field but ``resume`` (how to start is not what to make); ``prediction_type`` only when
        it is not epsilon, the only target before the field existed, so folders fitted then
        stay valid and an epsilon fit's config.json keeps its bytes. ``report_judges`` only
        measure, so they are left out too."""
        skip = ("resume", "report_judges")  # how to start and what else measures: not what to make
        out = {k: v for k, v in self.to_dict().items() if k not in skip}
        if out.get("prediction_type") == "epsilon":
            del out["prediction_type"]
        if not out.get("clip_choice"):  # recorded when on: earlier fits keep their config.json
            out.pop("clip_choice", None)
        return out

    @property
    def grid(self) -> tuple[float, ...]:
        """The guidance weights checked: without a null condition only w = 1 exists."""
        return tuple(sorted(set(self.guidance_grid))) if self.label_dropout > 0 else (1.0,)

    def __post_init__(self):
        check_choice("unet", self.unet, sorted(UNET_PRESETS))
        check_choice("beta_schedule", self.beta_schedule, BETA_SCHEDULES)
        check_choice("mixed_precision", self.mixed_precision, MIXED_PRECISION)
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
        if self.judge_run and self.judge_run in self.report_judges:
            raise ConfigError(
                f"report_judges names judge_run={self.judge_run!r}: it chooses already; "
                "report_judges= lists the others"
            )


# The digits recipe fits on 2 CPU cores in about 5 minutes (fp32: ~0.31 s per step at batch 128;
# for this ~1 M-parameter net at 16 px bf16 autocast's casts cost what its kernels save: 0.42 s
# a step on an Intel Xeon with AMX, bench/RESULTS.md); a high learning rate because the run is
# short. Linear betas: with the
# cosine schedule the same 500 steps leave colour casts (the digits are grey) in the samples.
# The CIFAR recipe follows DDPM (Ho et al. 2020) on EDM's DDPM++ capacity ("cifar" UNet): linear
# betas, lr 2e-4 after 5k warm-up steps, EMA 0.9999, flips, bf16; 400k steps at batch 128 per
# GPU (about a day on 8 GPUs); not run on the development machine.
_CIFAR = dict(
    unet="cifar",
    steps=400_000,
    batch_size=128,
    lr=2e-4,
    warmup_steps=5000,
    ema_decay=0.9999,
    beta_schedule="linear",
    hflip=True,
    mixed_precision="bf16",
    checkpoint_every=5000,
    log_every=500,
)

PRESETS = {
    # 800 steps with label dropout, a cosine lr decay and Min-SNR-5 weighting: the chain's
    # encoder takes 99.5 % of the endpoints for their digit at w = 2 (DDIM 15, fp32; 95.5 % at
    # w = 1.5 with DDIM 25 in bf16; the constant-lr recipe without Min-SNR: 90 % at 750 steps,
    # 94 % at 1,000; w = 3 collapses to ~37 %); ~4.5 min on 2 cores (docs/generate.md, "Guidance")
    "digits": dict(
        unet="digits-tiny",
        steps=800,
        batch_size=128,
        lr=2e-3,
        lr_schedule="cosine",
        min_snr_gamma=5.0,
        ema_decay=0.995,
        judge_run="encoder",
        guidance_grid=(1.0, 1.5, 2.0),
        fidelity_every=0,  # one check, at the end: `make generate` within 8 min on 2 cores
        sample_steps=15,  # the fidelity check and sample grid sample as generate does (DDIM 15)
        mixed_precision="no",  # fp32: faster than bf16 autocast for this tiny net (above)
    ),
    # Fashion-MNIST 28x28, the fair study's generator: only the 5k training images the study's
    # classifiers see (train_limit), no flips (every Fashion-MNIST shoe points the same way:
    # a flipped sneaker is an image the data never has), the digits recipe's guidance, cosine lr
    # and Min-SNR-5. w is chosen by the 5k "encoder" (inside the budget); the chain's 54k judges
    # ("judge", with flips; "judge-noflip") only report.
    # v-prediction: the judge takes 90.0 % of the endpoints for their class at w = 1.5 (Sneaker
    # 90 %); the same fit predicting ε reached 72.5 % (Sneaker 0 %): its x̂_0 at high noise is
    # noise (docs/generate.md, "Sampler, steps and the prediction target"). 2,500 steps at
    # ~0.75-1.2 s a step in bf16 on 2 cores: 31-50 min (docs/study.md has the curve).
    "fashion-mnist": dict(
        unet="fashion-28",
        prediction_type="v_prediction",
        steps=2500,
        batch_size=128,
        lr=2e-3,
        lr_schedule="cosine",
        min_snr_gamma=5.0,
        warmup_steps=50,
        ema_decay=0.998,
        hflip=False,
        train_limit=5000,
        judge_run="encoder",
        report_judges=("judge", "judge-noflip"),
        # w and DDIM's x̂₀ clipping chosen together by the encoder (clipping on, the scheduler's
        # default, injects guidance's out-of-range x̂₀ error at every step: bench/RESULTS.md,
        # "the guided sampler's levers"); the grid extended once past 2.5, where the choice sat
        # on its edge (bench/RESULTS.md, "x̂₀ clipping chosen like w")
        guidance_grid=(1.0, 1.5, 2.0, 2.5, 3.0, 3.5),
        clip_choice=True,
        fidelity_every=625,
        checkpoint_every=250,
        log_every=100,
    ),
    "cifar10": _CIFAR,
    "cifar100": _CIFAR,
}
