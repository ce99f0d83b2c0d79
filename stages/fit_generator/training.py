"""fit-generator's DDPM training on the one training loop (stages/common/loop.py, `train_units`).

Standard DDPM training (Ho et al. 2020): x_t = √ᾱ_t·x_0 + √(1−ᾱ_t)·ε, loss ‖ε − ε_θ(x_t, t, y)‖²
(or, with ``prediction_type=v_prediction``, ‖v − v_θ‖² with v = √ᾱ_t·ε − √(1−ᾱ_t)·x_0),
with diffusers' ``DDPMScheduler`` for the noise schedule, AdamW with a warm-up, an EMA of the
weights (what is saved: the generate stage samples from it) and accelerate for devices,
processes, checkpoints and bf16 autocast (``mixed_precision=auto``: on CPUs with native bf16
too, 1.3x faster there).

The loop's unit is a block of ``checkpoint_every`` optimizer steps (`DDPMSteps`): after each
block, checkpoint_<i> (i counts the blocks from 0). A checkpoint is accelerate's save_state
(safetensors model; optimizer, scheduler and RNG read back with weights_only) plus
ema.safetensors and the marker semix_state.json (step, EMA scalars, the fidelity curve so far),
written by the Checkpointer of shards/checkpoints.py: nothing is pickled by us or unpickled in
full.

Every random draw of step s (batch indices, flips, t, ε, dropout) comes from generators seeded by
(seed, s, rank), so a run resumed from a checkpoint (``resume=auto``, the default: the newest
complete one) ends with the very same weights as an uninterrupted one. The training set is
small (CIFAR size at most): it is held in device memory, batches are slices of per-epoch
permutations.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from diffusers import DDPMScheduler, UNet2DModel
from diffusers.training_utils import EMAModel

from core.logs import log, progress
from core.seeding import derive_seed, make_generator
from core.tracking import Tracking
from models.generators import UNET_PRESETS, UNetGenerator, unet_from_preset
from models.generators.objective import denoising_loss, denoising_target
from shards.checkpoints import MARKER, CheckpointError
from stages.common.fidelity import FidelityCheck, fidelity_scalars
from stages.common.loop import drain, make_accelerator, train_units
from stages.configs.fit_generator import Config

CHECKPOINTS = "checkpoints"  # the run's checkpoint folder (stages.common.loop.train_units)
STATE = MARKER  # in a checkpoint folder, written last: the checkpoint is complete
EMA = "ema.safetensors"  # the EMA weights of a checkpoint (its scalars live in STATE)
# The stage's Accelerator arguments. The lr schedule counts optimiser steps: one scheduler step
# per step on any number of processes (accelerate's default steps a prepared scheduler
# num_processes times per step, for schedules counted in samples).
ACCELERATOR_KWARGS = {"step_scheduler_with_optimizer": False}


def batch_indices(n: int, seed: int, step: int, batch: int, rank: int, world: int) -> torch.Tensor:
    """Rows of step `step` on `rank`: a slice of the endless sequence of per-epoch permutations.

    Global position p = (step·world + rank)·batch + i; epoch e = p // n uses randperm(n) seeded by
    (seed, e). Every image is seen once per epoch, and any step can be recomputed from nothing.
    """
    pos = torch.arange((step * world + rank) * batch, (step * world + rank + 1) * batch)
    out = torch.empty(batch, dtype=torch.long)
    epochs = pos // n
    for e in epochs.unique().tolist():
        perm = torch.randperm(n, generator=make_generator(seed, "fit-epoch", e))
        mask = epochs == e
        out[mask] = perm[pos[mask] % n]
    return out


def noise_scheduler(cfg: Config) -> DDPMScheduler:
    """The noise schedule (saved for the sampler): DDIM starts at t = T−1 ("trailing")."""
    return DDPMScheduler(
        num_train_timesteps=cfg.noise.num_train_timesteps,
        beta_schedule=cfg.noise.beta_schedule,
        prediction_type=cfg.noise.prediction_type,
        timestep_spacing="trailing",
        rescale_betas_zero_snr=cfg.noise.zero_terminal_snr,
    )


def lr_factor(cfg: Config, step: int) -> float:
    """Linear warm-up, then constant or a cosine decay to 10 % at the last step."""
    warm = min(1.0, (step + 1) / max(cfg.optim.warmup_steps, 1))
    if cfg.optim.lr_schedule == "constant" or step < cfg.optim.warmup_steps:
        return warm
    done = (step - cfg.optim.warmup_steps) / max(cfg.train_steps - cfg.optim.warmup_steps, 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))


def ema_generator(cfg: Config, model: torch.nn.Module, ema: EMAModel) -> UNetGenerator:
    """The EMA weights of now, in float32 on the CPU, as a sampler (the training model is not
    touched)."""
    unet = copy.deepcopy(model).to("cpu").float()
    ema.copy_to(unet.parameters())
    return UNetGenerator.from_model(
        unet.eval(), noise_scheduler(cfg).config, steps=cfg.preview.sample_steps
    )


class DDPMSteps:
    """The training as the loop's units: blocks of `checkpoint_every` optimizer steps, the last
    one shorter when they do not divide `steps`; checkpoint_<i> after block i holds step
    min(every·(i+1), steps). Within a block: the DDPM step, the loss in the logs every
    `log_every` steps, a point of the fidelity curve every `fidelity_every` steps and at the
    last (main process, which alone has a `check`).

    `images` (uint8 [N, H, W, 3]) and `labels` move to the device; each batch becomes [-1, 1]
    floats when it is drawn."""

    files = (EMA,)

    def __init__(
        self,
        cfg: Config,
        accelerator: Accelerator,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_schedule: torch.optim.lr_scheduler.LRScheduler,
        ema: EMAModel,
        images: torch.Tensor,
        labels: torch.Tensor,
        num_classes: int,
        check: FidelityCheck | None,
    ) -> None:
        self.cfg, self.accelerator, self.model, self.ema = cfg, accelerator, model, ema
        self.optimizer, self.lr_schedule, self.check = optimizer, lr_schedule, check
        self.count = math.ceil(cfg.train_steps / cfg.checkpoint.every)
        self.step = 0  # optimizer steps done
        self.fidelity: list[dict[str, Any]] = []  # [{"step": s, "guidance": {w: {judge: stats}}}]
        device = accelerator.device
        self.images = images.permute(0, 3, 1, 2).contiguous().to(device)
        self.labels = labels.to(device)
        self.num_classes = num_classes
        self.alphas_cumprod = noise_scheduler(cfg).alphas_cumprod.to(device)
        self.snr = self.alphas_cumprod / (1 - self.alphas_cumprod)  # SNR(t) = ᾱ_t / (1 − ᾱ_t)
        self.dropout = UNET_PRESETS[cfg.unet].dropout > 0
        # the loss since the last log line, summed on the device: no sync per step
        self.loss_sum, self.loss_n = torch.zeros((), device=device), 0

    # ------------------------------------------------------------ the loop's hooks

    def restore(self, path: Path, saved: dict[str, Any], tensors: dict[str, Any]) -> int:
        """The EMA weights and scalars, the step and the fidelity curve of checkpoint `path`."""
        shadow, ema = tensors[EMA], self.ema
        if sorted(shadow, key=int) != [str(i) for i in range(len(ema.shadow_params))]:
            raise CheckpointError(
                f"{path / EMA}: EMA weights of another model; start over (checkpoint.resume=)"
            )
        ema.load_state_dict(
            {**saved["ema"], "shadow_params": [shadow[str(i)] for i in range(len(shadow))]}
        )
        ema.to(self.accelerator.device)
        self.step = int(saved["step"])
        self.fidelity = list(saved.get("fidelity", []))
        log.info("fit-generator: resumed from %s at step %d", path, self.step)
        return math.ceil(self.step / self.cfg.checkpoint.every)

    def bar(self, done: int) -> Any:
        bar = progress(
            range(self.cfg.train_steps),
            total=self.cfg.train_steps,
            desc="fit-generator",
            unit="step",
            enabled=self.accelerator.is_main_process,
        )
        bar.update(self.step)
        return bar

    def train(self, unit: int, bar: Any) -> None:
        every = self.cfg.checkpoint.every
        for step in range(unit * every, min((unit + 1) * every, self.cfg.train_steps)):
            loss, lr = self.train_step(step)
            self.step = step + 1
            bar.update(1)
            self.log_loss(loss, lr, bar)
            self.check_fidelity()

    def checkpoint(self, unit: int) -> tuple[int, dict[str, Any], dict[str, Any]]:
        """checkpoint_<unit>: the step, the EMA (its scalars in the marker, its weights in EMA)
        and the fidelity curve. No Python object is registered with accelerate: it would pickle
        it, and unpickle it in full on resume."""
        shadow = {f"{i}": p for i, p in enumerate(self.ema.shadow_params)}
        scalars = {k: v for k, v in self.ema.state_dict().items() if k != "shadow_params"}
        state = {"step": self.step, "ema": scalars, "fidelity": self.fidelity}
        return unit, state, {EMA: shadow}

    def report(self, unit: int) -> None:
        """Nothing: a block's losses and fidelity points are reported as they come."""

    # ------------------------------------------------------------ one step

    def train_step(self, step: int) -> tuple[torch.Tensor, float]:
        """One optimizer step on this process's batch of step `step`: (its loss, the lr it
        used)."""
        cfg, accelerator, model = self.cfg, self.accelerator, self.model
        device, rank = accelerator.device, accelerator.process_index
        g = make_generator(cfg.seed, "fit-step", step, rank)
        idx = batch_indices(
            len(self.images), cfg.seed, step, cfg.batch_size, rank, accelerator.num_processes
        ).to(device)
        x0 = self.images[idx].float() / 127.5 - 1
        if cfg.augment.flip:
            flip = (torch.rand(len(idx), generator=g) < 0.5).to(device)
            x0 = torch.where(flip[:, None, None, None], x0.flip(-1), x0)
        eps = torch.randn(x0.shape, generator=g).to(device)
        t = torch.randint(0, cfg.noise.num_train_timesteps, (len(idx),), generator=g).to(device)
        y = self.labels[idx]
        if cfg.label_dropout > 0:  # drawn last: the other draws are the same without dropout
            drop = (torch.rand(len(idx), generator=g) < cfg.label_dropout).to(device)
            y = torch.where(drop, self.num_classes, y)  # row C of the table: the null condition ∅
        a_bar = self.alphas_cumprod[t][:, None, None, None]
        x_t = a_bar.sqrt() * x0 + (1 - a_bar).sqrt() * eps  # forward process q(x_t | x_0)
        with torch.random.fork_rng(
            devices=[device] if device.type == "cuda" else [], enabled=self.dropout
        ):
            if self.dropout:  # dropout cannot take a generator: seed the forked global RNG
                torch.manual_seed(derive_seed(cfg.seed, "fit-dropout", step, rank))
            with accelerator.autocast():
                pred = model(x_t, t, class_labels=y).sample
            target = denoising_target(x0, eps, a_bar, cfg.noise.prediction_type)
            loss = denoising_loss(
                pred.float(),
                target,
                self.snr[t],
                cfg.optim.min_snr_gamma,
                cfg.noise.prediction_type,
            )
            accelerator.backward(loss)
        if cfg.optim.clip_norm > 0:
            accelerator.clip_grad_norm_(model.parameters(), cfg.optim.clip_norm)
        lr = self.optimizer.param_groups[0]["lr"]  # this step's (for the trackers)
        self.optimizer.step()
        self.lr_schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.ema.step(accelerator.unwrap_model(model).parameters())
        return loss, lr

    def log_loss(self, loss: torch.Tensor, lr: float, bar: Any) -> None:
        """The mean loss since the last line, every `log_every` steps and at the last."""
        cfg = self.cfg
        self.loss_sum, self.loss_n = self.loss_sum + loss.detach(), self.loss_n + 1
        if self.step % cfg.log_every == 0 or self.step == cfg.train_steps:
            mean = self.loss_sum.item() / self.loss_n
            bar.set_postfix(loss=f"{mean:.4f}")
            log.info("fit-generator: step %d/%d loss %.4f", self.step, cfg.train_steps, mean)
            self.accelerator.log({"loss": mean, "lr": lr}, step=self.step)  # main process
            self.loss_sum, self.loss_n = torch.zeros((), device=self.accelerator.device), 0

    def check_fidelity(self) -> None:
        """A point of the fidelity curve with the EMA weights, every `fidelity_every` steps and
        at the last (main process)."""
        cfg = self.cfg
        due = cfg.fidelity.every and self.step % cfg.fidelity.every == 0
        if self.check is not None and (due or self.step == cfg.train_steps):
            unet = self.accelerator.unwrap_model(self.model)
            self.fidelity.append(self.check(ema_generator(cfg, unet, self.ema), self.step))
            self.accelerator.log(fidelity_scalars(self.fidelity[-1]), step=self.step)


def train(
    cfg: Config,
    folder: Path,
    images: torch.Tensor,
    labels: torch.Tensor,
    names: tuple[str, ...],
    check: FidelityCheck | None,
) -> tuple[UNet2DModel, list[dict[str, Any]]]:
    """DDPM training in `folder`; returns the EMA weights (a UNet on the CPU) on every process,
    and the fidelity curve (the main process, which alone gets `check`)."""
    cpu = cfg.device == "cpu" or not torch.cuda.is_available()  # else torchrun ranks unseen
    tracking = Tracking.of(cfg.tracker, folder, cfg.root)  # tracker=: outside the folder's files
    kwargs = ACCELERATOR_KWARGS | tracking.accelerator_kwargs()
    accelerator = make_accelerator(cfg.precision, cpu=cpu, **kwargs)
    with torch.random.fork_rng(devices=[]):  # the random init, seeded, global RNG left alone
        torch.manual_seed(derive_seed(cfg.seed, "fit-init"))
        unet = unet_from_preset(cfg.unet, len(names), null_class=cfg.label_dropout > 0)
    opt = torch.optim.AdamW(unet.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s))
    model, opt, lr_sched = accelerator.prepare(unet, opt, lr_sched)
    ema = EMAModel(unet.parameters(), decay=cfg.optim.ema_decay)
    steps = DDPMSteps(
        cfg, accelerator, model, opt, lr_sched, ema, images, labels, len(names), check
    )
    model.train()
    tracking.start(accelerator, cfg.to_dict())
    try:
        drain(train_units(steps, accelerator, folder, cfg.checkpoint.limit, cfg.checkpoint.resume))
    finally:
        tracking.finish(accelerator)  # before anything of the folder's own is written
    accelerator.wait_for_everyone()

    final = accelerator.unwrap_model(model)  # the EMA weights into the model, on the CPU
    ema.copy_to(final.parameters())
    return final.to("cpu").float().eval(), steps.fidelity
