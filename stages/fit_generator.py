"""fit-generator: real/train -> runs/<classes>/generator/, the in-house class-conditional UNet.

    python -m pipeline fit-generator --preset digits
    accelerate launch --multi_gpu -m pipeline fit-generator --preset cifar10

Standard DDPM training (Ho et al. 2020): x_t = √ᾱ_t·x_0 + √(1−ᾱ_t)·ε, loss ‖ε − ε_θ(x_t, t, y)‖²,
with diffusers' ``DDPMScheduler`` for the noise schedule, AdamW, an EMA of the weights (what is
saved: the generate stage samples from it) and accelerate for devices, processes and checkpoints.

Every random draw of step s (batch indices, flips, t, ε, dropout) comes from generators seeded by
(seed, s, rank), so a run resumed from a checkpoint (``resume=latest``, the default) ends with the
very same weights as an uninterrupted one. The training set is small (CIFAR size at most): it is held
in device memory, batches are slices of per-epoch permutations.

Folder: unet/ + scheduler/ (``save_unet``), config.json, sample_grid.png, manifest.json last
(kind ``generator``, no shards). Checkpoints under checkpoints/checkpoint_<i>/: accelerate's
save_state (safetensors model; optimizer, scheduler and RNG read back with weights_only) plus our
ema.safetensors and semix_state.json (step + EMA scalars, written last = complete); nothing is
pickled by us or unpickled in full (shards/checkpoints.py). They are removed once the manifest
is written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator, PartialState
from accelerate.utils import ProjectConfiguration
from diffusers import DDPMScheduler, UNet2DModel
from diffusers.training_utils import EMAModel
from safetensors.torch import save_file

from models.generators import UNET_PRESETS, SeriesSpec, load_generator, save_unet, unet_from_preset
from pipeline.configs.fit_generator import Config
from pipeline.plots import image_grid
from pipeline.runtime import code_version, derive_seed, log, make_generator, progress
from shards.checkpoints import LOAD_KWARGS, check_checkpoint
from shards.io import atomic_write_json, read_json, sha256_file, tmp_path_for
from shards.manifest import MANIFEST, Manifest, ShardError, manifest_digest, write_manifest
from shards.reader import load_split
from shards.runs import load_safetensors
from shards.writer import write_config

WEIGHTS = Path("unet") / "diffusion_pytorch_model.safetensors"
CHECKPOINTS = "checkpoints"


STATE = "semix_state.json"  # in a checkpoint folder, written last: the checkpoint is complete
EMA = "ema.safetensors"  # the EMA weights of a checkpoint (its scalars live in STATE)


class TrainState:
    """The step counter, saved with every checkpoint (in STATE, as JSON)."""

    def __init__(self) -> None:
        self.step = 0


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
    """The training noise schedule; "trailing" spacing lets DDIM start from pure noise at t = T−1."""
    return DDPMScheduler(
        num_train_timesteps=cfg.num_train_timesteps,
        beta_schedule=cfg.beta_schedule,
        prediction_type="epsilon",
        timestep_spacing="trailing",
    )


def save_checkpoint(accelerator: Accelerator, ema: EMAModel, state: TrainState) -> None:
    """accelerate save_state under checkpoints/checkpoint_<i> (oldest removed past the limit),
    then the EMA weights (safetensors) and STATE (JSON, last). No Python object is registered
    with accelerate: it would pickle it, and unpickle it in full on resume."""
    path = Path(accelerator.save_state())
    if accelerator.is_main_process:
        shadow = {f"{i}": p.detach().cpu().contiguous() for i, p in enumerate(ema.shadow_params)}
        tmp = tmp_path_for(path / EMA)
        save_file(shadow, str(tmp))
        tmp.replace(path / EMA)
        scalars = {k: v for k, v in ema.state_dict().items() if k != "shadow_params"}
        atomic_write_json(path / STATE, {"step": state.step, "ema": scalars})
    accelerator.wait_for_everyone()


def load_checkpoint(accelerator: Accelerator, ckpt: Path, ema: EMAModel, state: TrainState) -> None:
    """Inverse of save_checkpoint; the folder is checked first (nothing in it is unpickled)."""
    check_checkpoint(ckpt, STATE, ours=(EMA,))
    accelerator.load_state(str(ckpt), load_kwargs=LOAD_KWARGS)
    saved = read_json(ckpt / STATE)
    shadow = load_safetensors(ckpt / EMA)
    if sorted(shadow, key=int) != [str(i) for i in range(len(ema.shadow_params))]:
        raise ShardError(f"{ckpt / EMA}: EMA weights of another model; start over (resume=)")
    ema.load_state_dict(
        {**saved["ema"], "shadow_params": [shadow[str(i)] for i in range(len(shadow))]}
    )
    state.step = int(saved["step"])


def complete_checkpoints(folder: Path) -> dict[int, Path]:
    ckpts = (folder / CHECKPOINTS).glob("checkpoint_*")
    return {int(p.name[11:]): p for p in ckpts if p.name[11:].isdigit() and (p / STATE).is_file()}


def latest_checkpoint(folder: Path) -> Path | None:
    complete = complete_checkpoints(folder)
    return complete[max(complete)] if complete else None


def resume_from(cfg: Config, folder: Path) -> Path | None:
    """The checkpoint to resume from: the latest complete one (if any), none, or a folder."""
    if cfg.resume == "":  # start over: old checkpoints would clash with the new names
        shutil.rmtree(folder / CHECKPOINTS, ignore_errors=True)
        return None
    if cfg.resume == "latest":
        ckpt = latest_checkpoint(folder)
        # newer folders are incomplete (killed while saving): the next save reuses their names
        newest = int(ckpt.name[11:]) if ckpt is not None else -1
        for path in (folder / CHECKPOINTS).glob("checkpoint_*"):
            if path.name[11:].isdigit() and int(path.name[11:]) > newest:
                shutil.rmtree(path, ignore_errors=True)
        return ckpt
    path = Path(cfg.resume)
    if not path.is_dir() or not path.name[11:].isdigit() or path.name[:11] != "checkpoint_":
        raise ShardError(f"resume={cfg.resume}: not a checkpoint_<n> folder (or use resume=latest)")
    return check_checkpoint(path, STATE, ours=(EMA,))


def train(
    cfg: Config, folder: Path, images: torch.Tensor, labels: torch.Tensor, num_classes: int
) -> UNet2DModel:
    """DDPM training; returns the EMA weights (a UNet on the CPU) on every process."""
    # 1. Accelerator, model, optimiser, schedules
    accelerator = Accelerator(
        cpu=cfg.device == "cpu" or not torch.cuda.is_available(),  # else torchrun ranks unseen
        mixed_precision=cfg.mixed_precision,
        project_config=ProjectConfiguration(
            project_dir=str(folder),
            automatic_checkpoint_naming=True,
            total_limit=cfg.checkpoints_total_limit,
        ),
    )
    with torch.random.fork_rng(devices=[]):  # the random init, seeded, global RNG left alone
        torch.manual_seed(derive_seed(cfg.seed, "fit-init"))
        unet = unet_from_preset(cfg.unet, num_classes=num_classes)
    sched = noise_scheduler(cfg)
    opt = torch.optim.AdamW(unet.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warmup = max(cfg.warmup_steps, 1)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    model, opt, lr_sched = accelerator.prepare(unet, opt, lr_sched)
    ema = EMAModel(unet.parameters(), decay=cfg.ema_decay)
    state = TrainState()

    # 2. Resume
    ckpt = resume_from(cfg, folder)
    if ckpt is not None:
        load_checkpoint(accelerator, ckpt, ema, state)
        ema.to(accelerator.device)
        # the next automatic checkpoint name continues after the one we loaded
        accelerator.project_configuration.iteration = int(ckpt.name.rpartition("_")[2]) + 1
        log.info("fit-generator: resumed from %s at step %d", ckpt, state.step)

    # 3. Training loop: the data live on the device, uint8 -> [-1, 1] per batch
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    images = images.permute(0, 3, 1, 2).contiguous().to(device)
    labels = labels.to(device)
    alphas_cumprod = sched.alphas_cumprod.to(device)
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
        a_bar = alphas_cumprod[t][:, None, None, None]
        x_t = a_bar.sqrt() * x0 + (1 - a_bar).sqrt() * eps  # forward process q(x_t | x_0)
        with torch.random.fork_rng(
            devices=[device] if device.type == "cuda" else [], enabled=dropout
        ):
            if dropout:  # dropout cannot take a generator: seed the forked global RNG per step
                torch.manual_seed(derive_seed(cfg.seed, "fit-dropout", step, rank))
            with accelerator.autocast():
                pred = model(x_t, t, class_labels=labels[idx]).sample
            loss = F.mse_loss(pred.float(), eps)
            accelerator.backward(loss)
        if cfg.grad_clip > 0:
            accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
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
            loss_sum, loss_n = torch.zeros((), device=device), 0
        if state.step % cfg.checkpoint_every == 0 or state.step == cfg.steps:
            save_checkpoint(accelerator, ema, state)
    bar.close()
    accelerator.wait_for_everyone()

    # 4. The EMA weights into the model, on the CPU
    final = accelerator.unwrap_model(model)
    ema.copy_to(final.parameters())
    return final.to("cpu").float().eval()


def sample_grid(cfg: Config, folder: Path, class_names: tuple[str, ...], device) -> Path:
    """sample_grid.png from the saved folder (the generate stage's loading path): one row per
    class; column j shares one noise across classes, so rows differ only in the class."""
    gen = load_generator("unet", model=folder, steps=cfg.sample_steps, device=device)
    n = cfg.samples_per_class
    seeds = [derive_seed(cfg.seed, "fit-grid", j) for j in range(n)]
    specs = [
        SeriesSpec(c * n + j, c, c, (1.0,), seeds[j])
        for c in range(len(class_names))
        for j in range(n)
    ]
    images = gen.generate_series(specs).view(len(class_names), n, *gen.noise_shape[1:], 3)
    scale = max(1, 64 // gen.image_size)
    return image_grid(
        images.numpy(), folder / "sample_grid.png", row_labels=class_names, scale=scale
    )


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
    config = {k: v for k, v in cfg.to_dict().items() if k != "resume"}
    write_config(folder, config)
    if (folder / MANIFEST).is_file():
        log.info("fit-generator: %s is complete already", folder)
        return folder
    names = split.class_names
    log.info(
        "fit-generator: %s UNet, %d classes, %d images, %d steps x %d -> %s",
        cfg.unet, len(names), len(split), cfg.steps, cfg.batch_size, folder,
    )  # fmt: skip

    # 2. Train (every process), save the EMA weights and the sample grid (main process)
    unet = train(cfg, folder, split.images, split.labels, len(names))
    state = PartialState()
    if not state.is_main_process:
        return folder
    save_unet(folder, unet, noise_scheduler(cfg))
    sample_grid(cfg, folder, names, state.device)

    # 3. Manifest last, then the training checkpoints go
    info = {
        "backend": "unet",
        "unet": cfg.unet,
        "image_size": size,
        "num_classes": len(names),
        "class_names": list(names),
        "train_steps": cfg.steps,
        "epochs": round(cfg.steps * cfg.batch_size * state.num_processes / len(split), 2),
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
    write_manifest(folder, manifest)
    shutil.rmtree(folder / CHECKPOINTS, ignore_errors=True)
    log.info("fit-generator: wrote %s (sample grid: %s)", folder, folder / "sample_grid.png")
    return folder
