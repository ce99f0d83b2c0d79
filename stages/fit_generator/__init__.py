"""fit-generator: real/train -> runs/<classes>/generator/, the in-house class-conditional UNet.

    python -m pipeline fit-generator --preset digits
    accelerate launch --multi_gpu -m pipeline fit-generator --preset cifar10

Standard DDPM training (Ho et al. 2020): x_t = √ᾱ_t·x_0 + √(1−ᾱ_t)·ε, loss ‖ε − ε_θ(x_t, t, y)‖²
(or, with ``prediction_type=v_prediction``, ‖v − v_θ‖² with v = √ᾱ_t·ε − √(1−ᾱ_t)·x_0),
with diffusers' ``DDPMScheduler`` for the noise schedule, AdamW, an EMA of the weights (what is
saved: the generate stage samples from it) and accelerate for devices, processes, checkpoints
and bf16 autocast (``mixed_precision=auto``: on CPUs with native bf16 too, 1.3x faster there).

Classifier-free guidance: with ``label_dropout`` p > 0 the class table has a null row ∅ and a
share p of the training labels is replaced by it, so one network learns ε(x_t, y) and ε(x_t, ∅).
While it fits (every ``fidelity_every`` steps and at the end) the EMA weights draw pure-class
images from a fixed noise for every w of ``guidance_grid``, judged by a real-only CNN
(``judge_run``) and a linear probe (stages/common/fidelity.py): the curve goes to fidelity.json and
fidelity.png, and the best w (by the CNN) becomes the generator's recorded guidance, which
generate uses by default (``guidance=auto``).

Every random draw of step s (batch indices, flips, t, ε, dropout) comes from generators seeded by
(seed, s, rank), so a run resumed from a checkpoint (``resume=auto``, the default: the newest
complete one) ends with the very same weights as an uninterrupted one. The training set is small (CIFAR size at most): it is held
in device memory, batches are slices of per-epoch permutations.

Folder: unet/ + scheduler/ (``save_unet``), config.json, sample_grid.png, fidelity.json and
fidelity.png, manifest.json last (kind ``generator``, no shards; its info records ``null_class``
and the chosen ``guidance``). Checkpoints under checkpoints/checkpoint_<i>/ (the same
Checkpointer as train and finetune, shards/checkpoints.py: written to a temporary folder, marker
last, renamed, then older ones pruned): accelerate's save_state (safetensors model; optimizer,
scheduler and RNG read back with weights_only) plus our ema.safetensors and semix_state.json
(step + EMA scalars); nothing is pickled by us or unpickled in full. They are removed just
before the manifest is written (a kill in between costs a retraining, never a wrong folder).
"""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from diffusers import DDPMScheduler, UNet2DModel
from diffusers.training_utils import EMAModel

from core.io import sha256_file, writing
from core.logs import log, progress
from core.precision import ACCELERATE
from core.precision import resolve_precision as resolve_precision_of
from core.runtime import (
    Processes,
    code_version,
    derive_seed,
    make_accelerator,
    make_generator,
    share_from_main,
)
from core.tracking import Tracking
from models.generators import (
    UNET_PRESETS,
    UNetGenerator,
    save_unet,
    unet_from_preset,
)
from models.generators.objective import denoising_loss, denoising_target
from shards.checkpoints import LOAD_KWARGS, MARKER, Checkpointer, CheckpointError
from shards.manifest import (
    Manifest,
    ShardError,
    is_complete,
    manifest_digest,
    read_manifest,
    write_manifest,
)
from shards.reader import load_split
from shards.writer import write_config
from stages.common.fidelity import FidelityCheck, fidelity_scalars, make_judges, sample_grid
from stages.configs.fit_generator import Config
from stages.fit_generator.recheck import recheck, recheck_fields

WEIGHTS = Path("unet") / "diffusion_pytorch_model.safetensors"


def check_weights(folder: Path) -> None:
    """A complete generator's weights are the file its manifest pins (size and sha256): a rerun
    never calls a truncated or replaced file complete, it names it and the fix."""
    path, expected = folder / WEIGHTS, read_manifest(folder).info.get("weights_sha256")
    if expected and (not path.is_file() or sha256_file(path) != expected):
        what = "is missing" if not path.is_file() else "differs from its manifest's sha256"
        raise ShardError(
            f"{path} {what} (damaged after fit-generator finished); remove {folder} and rerun "
            "the same command"
        )


CHECKPOINTS = "checkpoints"


STATE = MARKER  # in a checkpoint folder, written last: the checkpoint is complete
EMA = "ema.safetensors"  # the EMA weights of a checkpoint (its scalars live in STATE)


class TrainState:
    """The step counter and the fidelity curve so far, saved with every checkpoint (in STATE,
    as JSON)."""

    def __init__(self, checkpoint_every: int) -> None:
        self.step, self.every = 0, checkpoint_every
        self.fidelity: list[dict[str, Any]] = []  # [{"step": s, "guidance": {w: {judge: stats}}}]

    @property
    def number(self) -> int:
        """The checkpoint number of the save at this step: saves come every `every` steps and
        at the last one, so checkpoint_<i> holds step min(every·(i+1), steps)."""
        return (self.step - 1) // self.every


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
        num_train_timesteps=cfg.num_train_timesteps,
        beta_schedule=cfg.beta_schedule,
        prediction_type=cfg.prediction_type,
        timestep_spacing="trailing",
        rescale_betas_zero_snr=cfg.zero_terminal_snr,
    )


def save_checkpoint(
    accelerator: Accelerator, ckpt: Checkpointer, ema: EMAModel, state: TrainState
) -> None:
    """checkpoint_<i> after step `state.step` (i counts the saves): accelerate's save_state, the
    EMA weights (safetensors) and STATE (JSON, last), then older ones pruned (the Checkpointer's
    protocol). No Python object is registered with accelerate: it would pickle it, and unpickle
    it in full on resume."""
    shadow = {f"{i}": p for i, p in enumerate(ema.shadow_params)}
    scalars = {k: v for k, v in ema.state_dict().items() if k != "shadow_params"}
    ckpt.save(
        state.number,
        lambda folder: accelerator.save_state(str(folder)),
        {"step": state.step, "ema": scalars, "fidelity": state.fidelity},
        {EMA: shadow},
    )


def load_checkpoint(
    accelerator: Accelerator, ckpt: Checkpointer, path: Path, ema: EMAModel, state: TrainState
) -> None:
    """Inverse of save_checkpoint; the folder is checked first (nothing in it is unpickled)."""
    saved, tensors = ckpt.load(
        path, lambda p: accelerator.load_state(str(p), load_kwargs=LOAD_KWARGS)
    )
    shadow = tensors[EMA]
    if sorted(shadow, key=int) != [str(i) for i in range(len(ema.shadow_params))]:
        raise CheckpointError(f"{path / EMA}: EMA weights of another model; start over (resume=)")
    ema.load_state_dict(
        {**saved["ema"], "shadow_params": [shadow[str(i)] for i in range(len(shadow))]}
    )
    state.step = int(saved["step"])
    state.fidelity = list(saved.get("fidelity", []))


def lr_factor(cfg: Config, step: int) -> float:
    """Linear warm-up, then constant or a cosine decay to 10 % at the last step."""
    warm = min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
    if cfg.lr_schedule == "constant" or step < cfg.warmup_steps:
        return warm
    done = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))


def resolve_precision(choice: str, cpu: bool) -> str:
    """accelerate's mixed precision ("no", "bf16", "fp16") for mixed_precision=`choice`: auto is
    bf16 where the device computes it natively, CPUs with AVX512-BF16 or AMX included (the fit is
    1.3x faster there), else fp32; under `accelerate launch` accelerate's value (core/precision.py)."""
    device = torch.device("cpu" if cpu else "cuda")
    return ACCELERATE[resolve_precision_of("mixed_precision", choice, device, cpu_bf16=True)]


def fit_accelerator(cpu: bool, precision: str, tracking: Tracking) -> Accelerator:
    """The stage's Accelerator. The lr schedule counts optimiser steps: one scheduler step per
    step on any number of processes (accelerate's default steps a prepared scheduler
    num_processes times per step, for schedules counted in samples)."""
    return make_accelerator(
        cpu=cpu,
        mixed_precision=precision,
        step_scheduler_with_optimizer=False,
        **tracking.accelerator_kwargs(),
    )


def ema_generator(cfg: Config, model: torch.nn.Module, ema: EMAModel) -> UNetGenerator:
    """The EMA weights of now, in float32 on the CPU, as a sampler (the training model is not
    touched)."""
    unet = copy.deepcopy(model).to("cpu").float()
    ema.copy_to(unet.parameters())
    return UNetGenerator.from_model(
        unet.eval(), noise_scheduler(cfg).config, steps=cfg.sample_steps
    )


def train(
    cfg: Config,
    folder: Path,
    images: torch.Tensor,
    labels: torch.Tensor,
    names: tuple[str, ...],
    check: FidelityCheck | None,
) -> tuple[UNet2DModel, list[dict[str, Any]]]:
    """DDPM training; returns the EMA weights (a UNet on the CPU) on every process, and the
    fidelity curve (the main process, which alone gets `check`)."""
    # 1. Accelerator, model, optimiser, schedules
    cpu = cfg.device == "cpu" or not torch.cuda.is_available()  # else torchrun ranks unseen
    precision = resolve_precision(cfg.mixed_precision, cpu)
    tracking = Tracking.of(cfg.tracker, folder, cfg.root)  # tracker=: outside the folder's files
    accelerator = fit_accelerator(cpu, precision, tracking)
    num_classes, null_class = len(names), cfg.label_dropout > 0
    ckpt = Checkpointer(
        folder / CHECKPOINTS,
        keep=cfg.checkpoints_total_limit,
        files=(EMA,),
        is_main=accelerator.is_main_process,
        barrier=accelerator.wait_for_everyone,
        share=share_from_main(accelerator),
        ranks=accelerator.num_processes,
    )
    with torch.random.fork_rng(devices=[]):  # the random init, seeded, global RNG left alone
        torch.manual_seed(derive_seed(cfg.seed, "fit-init"))
        unet = unet_from_preset(cfg.unet, num_classes, null_class=null_class)
    sched = noise_scheduler(cfg)
    opt = torch.optim.AdamW(unet.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s))
    model, opt, lr_sched = accelerator.prepare(unet, opt, lr_sched)
    ema = EMAModel(unet.parameters(), decay=cfg.ema_decay)
    state = TrainState(cfg.checkpoint_every)

    # 2. Resume: the newest complete checkpoint (or the one named); later ones are replayed.
    path = ckpt.choose(cfg.resume)
    if path is not None:
        load_checkpoint(accelerator, ckpt, path, ema, state)
        ema.to(accelerator.device)
        log.info("fit-generator: resumed from %s at step %d", path, state.step)
    ckpt.tidy(first_free=state.number + 1 if state.step else 0)
    tracking.start(accelerator, cfg.to_dict())

    # 3. Training loop: the data live on the device, uint8 -> [-1, 1] per batch
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    images = images.permute(0, 3, 1, 2).contiguous().to(device)
    labels = labels.to(device)
    alphas_cumprod = sched.alphas_cumprod.to(device)
    snr = alphas_cumprod / (1 - alphas_cumprod)  # SNR(t) = ᾱ_t / (1 − ᾱ_t)
    dropout = UNET_PRESETS[cfg.unet].dropout > 0
    model.train()
    loss_sum, loss_n = torch.zeros((), device=device), 0  # summed on the device: no sync per step
    bar = progress(
        range(state.step, cfg.steps),
        total=cfg.steps,
        desc="fit-generator",
        unit="step",
        enabled=accelerator.is_main_process,
    )
    bar.update(state.step)
    for step in bar:
        g = make_generator(cfg.seed, "fit-step", step, rank)
        idx = batch_indices(len(images), cfg.seed, step, cfg.batch_size, rank, world).to(device)
        x0 = images[idx].float() / 127.5 - 1
        if cfg.hflip:
            flip = (torch.rand(len(idx), generator=g) < 0.5).to(device)
            x0 = torch.where(flip[:, None, None, None], x0.flip(-1), x0)
        eps = torch.randn(x0.shape, generator=g).to(device)
        t = torch.randint(0, cfg.num_train_timesteps, (len(idx),), generator=g).to(device)
        y = labels[idx]
        if null_class:  # drawn after ε and t: without dropout every draw is as before
            drop = (torch.rand(len(idx), generator=g) < cfg.label_dropout).to(device)
            y = torch.where(drop, num_classes, y)  # row C of the table: the null condition ∅
        a_bar = alphas_cumprod[t][:, None, None, None]
        x_t = a_bar.sqrt() * x0 + (1 - a_bar).sqrt() * eps  # forward process q(x_t | x_0)
        with torch.random.fork_rng(
            devices=[device] if device.type == "cuda" else [], enabled=dropout
        ):
            if dropout:  # dropout cannot take a generator: seed the forked global RNG per step
                torch.manual_seed(derive_seed(cfg.seed, "fit-dropout", step, rank))
            with accelerator.autocast():
                pred = model(x_t, t, class_labels=y).sample
            target = denoising_target(x0, eps, a_bar, cfg.prediction_type)
            loss = denoising_loss(
                pred.float(), target, snr[t], cfg.min_snr_gamma, cfg.prediction_type
            )
            accelerator.backward(loss)
        if cfg.grad_clip > 0:
            accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        lr = opt.param_groups[0]["lr"]  # this step's (for the trackers)
        opt.step()
        lr_sched.step()
        opt.zero_grad(set_to_none=True)
        ema.step(accelerator.unwrap_model(model).parameters())
        state.step = step + 1
        loss_sum, loss_n = loss_sum + loss.detach(), loss_n + 1
        if state.step % cfg.log_every == 0 or state.step == cfg.steps:
            mean = loss_sum.item() / loss_n
            bar.set_postfix(loss=f"{mean:.4f}")
            log.info("fit-generator: step %d/%d loss %.4f", state.step, cfg.steps, mean)
            accelerator.log({"loss": mean, "lr": lr}, step=state.step)  # main process
            loss_sum, loss_n = torch.zeros((), device=device), 0
        due = cfg.fidelity_every and state.step % cfg.fidelity_every == 0
        if check is not None and (due or state.step == cfg.steps):
            gen = ema_generator(cfg, accelerator.unwrap_model(model), ema)
            state.fidelity.append(check(gen, state.step))
            accelerator.log(fidelity_scalars(state.fidelity[-1]), step=state.step)
        if state.step % cfg.checkpoint_every == 0 or state.step == cfg.steps:
            save_checkpoint(accelerator, ckpt, ema, state)
    bar.close()
    tracking.finish(accelerator)  # before anything of the folder's own is written
    accelerator.wait_for_everyone()

    # 4. The EMA weights into the model, on the CPU
    final = accelerator.unwrap_model(model)
    ema.copy_to(final.parameters())
    return final.to("cpu").float().eval(), state.fidelity


def run(cfg: Config) -> Path:
    # 1. Inputs and config (resume says how to start, not what to make: left out of config.json)
    real = cfg.root / "real" / "train"
    folder = cfg.root / "generator"
    split = load_split(real)
    size = UNET_PRESETS[cfg.unet].image_size
    if split.images.shape[1:3] != (size, size):
        raise ShardError(
            f"{real} holds {split.images.shape[2]}x{split.images.shape[1]} images, the "
            f"{cfg.unet!r} UNet makes {size}x{size}: pick another unet or prepare at image_size={size}"
        )
    config = cfg.recorded()
    # one writer (the other ranks only compare): ranks writing config.json at once share its
    # temp file, and one's rename fails once another's has moved it
    procs = Processes(cpu=cfg.device == "cpu" or not torch.cuda.is_available())
    if recheck_fields(folder, config):  # a finished fit, another check grid: redo the check
        return recheck(cfg, folder, config, split.class_names, procs)
    if procs.is_main or (folder / "config.json").is_file():
        write_config(folder, config)
    if is_complete(folder):
        check_weights(folder)
        log.info("fit-generator: %s is complete already", folder)
        return folder
    names = split.class_names
    images, labels = split.images, split.labels
    if cfg.train_limit:  # the first N, as train's train_limit: a fair study fits on its 5k
        images, labels = images[: cfg.train_limit], labels[: cfg.train_limit]
    precision = resolve_precision(cfg.mixed_precision, procs.device.type == "cpu")
    log.info(
        "fit-generator: %s UNet, %d classes, %d images, %d steps x %d, %s, %d threads, "
        "label dropout %g -> %s",
        cfg.unet, len(names), len(images), cfg.steps, cfg.batch_size,
        "fp32" if precision == "no" else precision, torch.get_num_threads(), cfg.label_dropout,
        folder,
    )  # fmt: skip

    # 2. The judges of fidelity (main process), then train (every process)
    check = None
    if procs.is_main:
        judges = make_judges(
            cfg.root, cfg.judge_run, procs.device, cfg.train_limit, cfg.report_judges
        )
        check = FidelityCheck(
            judges, cfg.grid, names, cfg.seed, cfg.fidelity_per_class, cfg.clip_choice
        )
    unet, curve = train(cfg, folder, images, labels, names, check)
    state = PartialState()
    if not state.is_main_process:
        return folder

    # 3. Weights, the fidelity curve and the chosen guidance, the sample grid at that guidance
    guidance, clip, summary = check.choose(curve)
    with writing(folder / "unet"):  # diffusers' writes lose the file name: name the folder
        save_unet(folder, unet, noise_scheduler(cfg))
    check.write(folder, curve, guidance, clip)
    sample_grid(
        folder, names, state.device, guidance, cfg.sample_steps, cfg.samples_per_class, cfg.seed,
        clip,
    )  # fmt: skip

    # 4. Manifest last, then the training checkpoints go
    info = {
        "backend": "unet",
        "unet": cfg.unet,
        "image_size": size,
        "num_classes": len(names),
        "class_names": list(names),
        "train_steps": cfg.steps,
        "train_images": len(images),
        "epochs": round(cfg.steps * cfg.batch_size * state.num_processes / len(images), 2),
        "mixed_precision": precision,
        "null_class": cfg.label_dropout > 0,
        "guidance": guidance,
        **({} if clip is None else {"clip_sample": clip}),
        "fidelity": summary,
        "weights_sha256": sha256_file(folder / WEIGHTS),
        "parameters": sum(p.numel() for p in unet.parameters()),
    }
    manifest = Manifest(
        kind="generator",
        class_names=names,
        shards=(),
        upstream={"real": manifest_digest(real)},
        code_version=code_version(),
        info=info,
    )
    shutil.rmtree(folder / CHECKPOINTS, ignore_errors=True)  # before the manifest: once it
    write_manifest(folder, manifest)  # exists, nothing in the folder changes
    log.info(
        "fit-generator: wrote %s (guidance %g; sample grid: %s)",
        folder, guidance, folder / "sample_grid.png",
    )  # fmt: skip
    return folder
