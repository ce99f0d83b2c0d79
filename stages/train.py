"""train: real/ (+ mixed/ for loss=csm) -> runs/<classes>/train/<run>/.

    python -m pipeline train --preset digits --set run=ce loss=ce
    accelerate launch -m pipeline train --preset cifar100 --set run=csm loss=csm
    torchrun --nproc_per_node 2 -m pipeline train ...       (CPU, gloo)

The datasets live in device memory; each step indexes a global batch, augments it on the
device and every process takes its slice (rank::world), so the samples and random draws of a
step do not depend on the number of processes. Every draw comes from a generator derived from
(seed, epoch, purpose), and a checkpoint is written after each epoch: a resumed run replays the
uninterrupted one exactly (bit for bit on CPU).

Run folder: config.json, checkpoints/checkpoint_<n>/ (accelerate save_state + semix_state.json,
written last = complete), best.safetensors while training, metrics.json (per-epoch history),
curves.png, and at the end model.safetensors + model.json of the best validation epoch.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, broadcast_object_list
from safetensors.torch import load_file, save_file

from models.annotation import soft_targets
from models.calibration import ece, nll, topk_accuracy
from models.classifiers import build_classifier
from models.simplex import softmax_targets
from models.training import (
    SeriesIndex,
    TrainingModule,
    build_objective,
    channel_stats,
    collect_logits,
    csm_targets,
    epoch_batches,
    interior_positions,
    multistep_lr,
    normalize,
    random_crop_flip,
    sample_csm_members,
)
from pipeline.configs.train import Config
from pipeline.plots import lines
from pipeline.runtime import code_version, derive_seed, log, make_generator, progress
from shards.checkpoints import LOAD_KWARGS, check_checkpoint
from shards.datasets import RealSplit, check_same_classes, load_real, load_series_table
from shards.io import atomic_write_json, read_json, tmp_path_for
from shards.manifest import ShardError
from shards.runs import META, save_weights
from shards.writer import write_config

STATE = "semix_state.json"  # inside a checkpoint folder, written after save_state: complete
BEST = "best.safetensors"


@dataclass
class TrainState:
    """What a checkpoint adds to accelerate's state: where we are and what we have seen."""

    next_epoch: int = 0
    best_epoch: int = -1
    best_val_acc: float = -1.0
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass
class Mixed:
    """The series table on the device, with the targets CSM trains on (METHODS §3)."""

    images: torch.Tensor  # uint8 [S, K, H, W, 3]
    classes: torch.Tensor  # [S, 2] (k-way: [S, k])
    soft: torch.Tensor  # t_a [S, K] (k-way: t over the tuple [S, K, k])
    index: SeriesIndex
    interior: torch.Tensor | None = None  # k-way: positions mixing >= 2 classes


@dataclass
class TrainData:
    """Everything a step reads: real/train, the series table (csm), normalisation tensors."""

    train: RealSplit
    mixed: Mixed | None
    mean: torch.Tensor  # [C] on the device
    std: torch.Tensor


# ---------------------------------------------------------------- 1. inputs


def load_mixed(cfg: Config, train: RealSplit, device: torch.device) -> Mixed:
    folder = Path(cfg.mixed) if cfg.mixed else cfg.root / "mixed"
    table = load_series_table(folder, train.class_names, device, image_size=train.image_size)
    index = SeriesIndex(table.classes, len(train.class_names))
    if index.missing():
        names = [train.class_names[c] for c in index.missing()]
        raise ShardError(
            f"{folder}: no complete series contains class(es) {names[:5]}; CSM needs all"
        )
    # s re-applied from λ̂ when asked (t_a = σ(s(λ̂ − 0.5)), METHODS §2; k-way: softmax((s/2)λ̂));
    # else the stored soft; the "ratio" ablation trains on the generation weights themselves
    # (t_a = α; k-way: t = w), no re-annotation
    kway = table.mix_classes > 2
    if cfg.csm_targets == "ratio":
        soft = table.alpha
    elif cfg.csm_sharpening:
        sharpen = softmax_targets if kway else soft_targets
        soft = sharpen(table.lambda_hat, cfg.csm_sharpening)
    else:
        soft = table.soft
    log.info(
        "mixed %s: %d complete series x %d members of %d classes (%d incomplete dropped)",
        folder,
        len(table),
        table.members,
        table.mix_classes,
        table.dropped,
    )
    interior = interior_positions(table.alpha[0]) if kway else None
    return Mixed(table.images, table.classes, soft.float(), index, interior)


def load_data(cfg: Config, device: torch.device) -> tuple[RealSplit, RealSplit]:
    real = cfg.root / "real"
    train, val = load_real(real / "train", device), load_real(real / "val", device)
    check_same_classes(f"{real / 'val'}", val.class_names, train.class_names, "real/train")
    if cfg.train_limit:
        n = cfg.train_limit
        train = RealSplit(train.images[:n], train.labels[:n], train.class_names)
    return train, val


# ---------------------------------------------------------------- 2. checkpoints


def complete_checkpoints(folder: Path) -> dict[int, Path]:
    found = {}
    for path in folder.glob("checkpoint_*"):
        number = path.name.removeprefix("checkpoint_")
        if number.isdigit() and (path / STATE).is_file():
            found[int(number)] = path
    return found


def choose_checkpoint(ckpt_dir: Path, resume: str) -> tuple[Path | None, int]:
    """(checkpoint to load or None, its number or -1). auto: newest if any; latest: newest, must
    exist; else a checkpoint folder path."""
    complete = complete_checkpoints(ckpt_dir)
    if resume in ("auto", "latest"):
        if not complete:
            if resume == "latest":
                raise ShardError(f"resume=latest: {ckpt_dir} holds no complete checkpoint")
            return None, -1
        n = max(complete)
        return complete[n], n
    path = Path(resume)
    if not (path / STATE).is_file():
        raise ShardError(f"resume={resume}: not a complete semix checkpoint (no {STATE})")
    number = path.name.removeprefix("checkpoint_")
    inside = path.resolve().parent == ckpt_dir.resolve() and number.isdigit()
    return path, int(number) if inside else max(complete, default=-1)


def drop_checkpoints_after(ckpt_dir: Path, number: int) -> None:
    """Remove checkpoint folders numbered above `number`: incomplete, or a future we replay."""
    for path in ckpt_dir.glob("checkpoint_*"):
        n = path.name.removeprefix("checkpoint_")
        if n.isdigit() and int(n) > number:
            shutil.rmtree(path)


def prune_checkpoints(ckpt_dir: Path, keep: int) -> None:
    """Leave the newest `keep` checkpoints, so accelerate's total_limit never has to delete."""
    numbered = sorted(
        (int(p.name.removeprefix("checkpoint_")), p)
        for p in ckpt_dir.glob("checkpoint_*")
        if p.name.removeprefix("checkpoint_").isdigit()
    )
    for _, path in numbered[: max(0, len(numbered) - keep)]:
        shutil.rmtree(path)


def save_best(path: Path, model: torch.nn.Module) -> None:
    tmp = tmp_path_for(path)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(tmp))
    tmp.replace(path)


def write_metrics(run_dir: Path, train_section: dict[str, Any]) -> None:
    """metrics.json is shared with evaluate: keep its other sections."""
    path = run_dir / "metrics.json"
    metrics = read_json(path) if path.is_file() else {}
    metrics["train"] = train_section
    atomic_write_json(path, metrics)


def is_finished(run_dir: Path) -> bool:
    path = run_dir / "metrics.json"
    done = path.is_file() and read_json(path).get("train", {}).get("finished", False)
    return bool(done) and (run_dir / META).is_file()


# ---------------------------------------------------------------- 3. one epoch


def make_batch(
    cfg: Config,
    idx: torch.Tensor,
    data: TrainData,
    rank: int,
    world: int,
    augment: torch.Generator,
    extra: torch.Generator,
) -> dict[str, Any]:
    """One step's inputs for this process: the global batch `idx` is augmented (and its CSM
    members sampled) as a whole, then sliced rank::world, so the draws do not depend on world."""
    train, mixed = data.train, data.mixed
    cl = idx.device.type == "cuda"  # channels_last on GPU
    images = random_crop_flip(train.images[idx], augment, cfg.crop_pad, cfg.flip)
    y = train.labels[idx]
    batch: dict[str, Any] = {
        "x": normalize(images[rank::world], data.mean, data.std, channels_last=cl),
        "y": y[rank::world],
    }
    if mixed is not None:  # METHODS §3: per real image, its series' best member + an interior one
        series, pos = sample_csm_members(
            y, mixed.index, mixed.soft, extra, check=False, interior=mixed.interior
        )
        syn = random_crop_flip(
            mixed.images[series, pos].flatten(0, 1), augment, cfg.crop_pad, cfg.flip
        )
        t = csm_targets(
            mixed.classes[series].flatten(0, 1),
            mixed.soft[series, pos].flatten(0, 1),
            mixed.index.num_classes,
        )
        mine = torch.arange(len(y), device=idx.device)[rank::world]
        rows = torch.stack([2 * mine, 2 * mine + 1], dim=1).flatten()  # members of my real images
        batch["x_syn"] = normalize(syn[rows], data.mean, data.std, channels_last=cl)
        batch["t_syn"] = t[rows]
    return batch


def train_epoch(
    cfg: Config,
    epoch: int,
    accelerator: Accelerator,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: TrainData,
    bar: Any,
) -> dict[str, float]:
    """One epoch; no host-device sync inside the loop (totals stay on the device)."""
    dev, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    order = make_generator(cfg.seed, "train", "epoch", epoch, "order")
    augment = make_generator(cfg.seed, "train", "epoch", epoch, "augment", device=dev)
    extra = make_generator(cfg.seed, "train", "epoch", epoch, "objective", device=dev)
    objective = accelerator.unwrap_model(module).objective
    clip_params = list(accelerator.unwrap_model(module).model.parameters())
    lr = multistep_lr(epoch, cfg.lr, cfg.milestones, cfg.lr_gamma)
    for group in optimizer.param_groups:
        group["lr"] = lr
    module.train()
    sums = torch.zeros(2, dtype=torch.float64, device=dev)  # loss sum, correct
    count = 0
    batches = [b.to(dev) for b in epoch_batches(len(data.train), cfg.batch_size, order, 2 * world)]
    for idx in batches:
        batch = objective.prepare(make_batch(cfg, idx, data, rank, world, augment, extra), extra)
        optimizer.zero_grad(set_to_none=True)
        loss, logits = module(**batch)
        accelerator.backward(loss)
        if cfg.clip_norm > 0:  # the classifier only: FeDLaS' gate is left out (METHODS §5)
            accelerator.clip_grad_norm_(clip_params, cfg.clip_norm)
        optimizer.step()
        n = batch["y"].numel()
        correct = (logits.detach().argmax(dim=1) == batch["y"]).sum()
        sums += torch.stack([loss.detach().double() * n, correct.double()])
        count += n
        bar.update(len(idx))
    totals = torch.cat([sums, sums.new_tensor([count])])
    loss_sum, correct, count = accelerator.reduce(totals, reduction="sum").tolist()
    return {"lr": lr, "loss": loss_sum / count, "train_acc": 100.0 * correct / count}


def validate(
    model: torch.nn.Module, val: RealSplit, mean, std, batch_size: int
) -> dict[str, float]:
    logits = collect_logits(model, val.images, mean, std, batch_size=batch_size)
    labels = val.labels.cpu()
    return {
        "val_acc": 100.0 * topk_accuracy(logits, labels),
        "val_ece": 100.0 * ece(logits, labels),
        "val_nll": nll(logits, labels),
    }


# ---------------------------------------------------------------- the stage


def run(cfg: Config) -> Path:
    """Train one run (see the module docstring); returns the run folder."""
    # 1. Accelerator (DDP under a launcher; bf16 on GPU) and the run folder.
    run_dir = cfg.root / "train" / cfg.run
    ckpt_dir = run_dir / "checkpoints"
    use_bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and torch.cuda.is_available())
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # so that torchrun/accelerate ranks on CPU use gloo
        mixed_precision="bf16" if use_bf16 else "no",
        project_config=ProjectConfiguration(
            project_dir=str(run_dir),
            automatic_checkpoint_naming=True,
            total_limit=cfg.checkpoint_limit,
        ),
    )
    main, dev = accelerator.is_main_process, accelerator.device
    if is_finished(run_dir):
        write_config(run_dir, cfg.record())  # refuses another config under the same run name
        log.info("train %s: already finished (%s); nothing to do", cfg.run, run_dir)
        return run_dir

    # 2. Data into device memory (bad input fails here, before anything is written).
    train, val = load_data(cfg, dev)
    classes = train.class_names
    probe = build_objective(cfg.loss, len(classes), **cfg.loss_params())
    mixed = load_mixed(cfg, train, dev) if probe.needs_mixed else None
    if main:
        write_config(run_dir, cfg.record())
    accelerator.wait_for_everyone()
    mean, std = channel_stats(train.images, cfg.in_channels)  # normalisation from real/train
    data = TrainData(train, mixed, torch.tensor(mean, device=dev), torch.tensor(std, device=dev))

    # 3. Model (+ objective parameters) and optimizer; init from (seed, "init").
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.seed, "train", "init"))
        model = build_classifier(
            cfg.model, len(classes), cfg.in_channels, pretrained=cfg.pretrained
        )
    objective = build_objective(
        cfg.loss,
        len(classes),
        generator=make_generator(cfg.seed, "train", "objective-init"),
        **cfg.loss_params(),
    )
    module = TrainingModule(model, objective).to(dev)
    if dev.type == "cuda":
        module = module.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(
        module.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
    )
    module, optimizer = accelerator.prepare(module, optimizer)

    # 4. Resume: the newest complete checkpoint (or the one named), replaying from the next epoch.
    state = TrainState()
    checkpoint, number = choose_checkpoint(ckpt_dir, cfg.resume)
    if main and ckpt_dir.is_dir():
        drop_checkpoints_after(ckpt_dir, number)
    accelerator.wait_for_everyone()
    if checkpoint is not None:
        check_checkpoint(checkpoint, STATE)  # only files that load without unpickling
        accelerator.load_state(str(checkpoint), load_kwargs=LOAD_KWARGS)
        state = TrainState(**read_json(checkpoint / STATE))
        log.info("train %s: resumed from %s (epoch %d done)", cfg.run, checkpoint, state.next_epoch)
    accelerator.project_configuration.iteration = number + 1
    log.info(
        "train %s: %s, loss %s, %d train / %d val images, %d process(es) on %s%s",
        *(cfg.run, cfg.model, cfg.loss, len(train), len(val), accelerator.num_processes, dev),
        ", bf16" if use_bf16 else "",
    )

    # 5. Epochs: train, validate (main), keep the best weights, checkpoint.
    net = accelerator.unwrap_model(module).model
    remaining = (cfg.epochs - state.next_epoch) * len(train)
    with progress(
        range(remaining), total=remaining, desc=f"train {cfg.run}", unit="img", enabled=main
    ) as bar:
        for epoch in range(state.next_epoch, cfg.epochs):
            t0 = time.perf_counter()
            stats = train_epoch(cfg, epoch, accelerator, module, optimizer, data, bar)
            seconds = time.perf_counter() - t0
            scores = [validate(net, val, mean, std, cfg.eval_batch_size) if main else None]
            stats |= broadcast_object_list(scores, from_process=0)[0]
            stats |= {
                "epoch": epoch,
                "seconds": round(seconds, 3),
                "images_per_s": round(len(train) / seconds, 1),
            }
            if stats["val_acc"] > state.best_val_acc:
                state.best_val_acc, state.best_epoch = stats["val_acc"], epoch
                if main:
                    save_best(run_dir / BEST, net)
            state.history.append(stats)
            state.next_epoch = epoch + 1
            if main and ckpt_dir.is_dir():
                prune_checkpoints(ckpt_dir, keep=cfg.checkpoint_limit - 1)
            accelerator.wait_for_everyone()
            path = Path(accelerator.save_state())
            if main:
                atomic_write_json(path / STATE, state.__dict__)  # last: the checkpoint is complete
                write_metrics(run_dir, _train_section(cfg, state, finished=False))
            accelerator.wait_for_everyone()
            log.info(
                "epoch %d/%d: loss %.4f, train acc %.1f %%, val acc %.2f %%, val ECE %.2f %%, "
                "lr %.3g, %.0f img/s",
                epoch + 1,
                cfg.epochs,
                *(
                    stats[k]
                    for k in ("loss", "train_acc", "val_acc", "val_ece", "lr", "images_per_s")
                ),
            )

    # 6. Final weights: the best validation epoch's, with what a reader needs to use them.
    if main:
        meta = {
            "arch": net.arch_config(),
            "class_names": list(classes),
            "image_size": train.image_size,
            "normalize": {"mean": mean, "std": std},
            "run": cfg.run,
            "loss": cfg.loss,
            "best_epoch": state.best_epoch,
            "best_val_acc": state.best_val_acc,
            "code_version": code_version(),
        }
        save_weights(run_dir, load_file(str(run_dir / BEST)), meta)
        write_metrics(run_dir, _train_section(cfg, state, finished=True))
        (run_dir / BEST).unlink()
        history = state.history
        lines(
            {
                "val acc (%)": [h["val_acc"] for h in history],
                "val ECE (%)": [h["val_ece"] for h in history],
            },
            run_dir / "curves.png",
            xlabel="epoch",
            title=f"{cfg.run} ({cfg.loss})",
        )
        log.info(
            "train %s: best epoch %d, val acc %.2f %% -> %s",
            cfg.run,
            state.best_epoch + 1,
            state.best_val_acc,
            run_dir,
        )
    accelerator.wait_for_everyone()
    return run_dir


def _train_section(cfg: Config, state: TrainState, finished: bool) -> dict[str, Any]:
    return {
        "run": cfg.run,
        "loss": cfg.loss,
        "model": cfg.model,
        "loss_params": cfg.loss_params(),
        "epochs": cfg.epochs,
        "best_epoch": state.best_epoch,
        "best_val_acc": state.best_val_acc,
        "history": state.history,
        "finished": finished,
    }
