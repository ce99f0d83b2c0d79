"""Training step rate: the train stage's data path (shards -> device tensors -> on-device
crop/flip + normalise, `stages.common.loop.train_epoch`) vs the same model, optimizer and step on
in-memory random tensors (no indexing, augmentation or normalisation). Goal: ratio >= 0.9.

GPU section (only when CUDA is available): ResNet-18 on CIFAR-sized images (32x32, 10 classes),
bf16 autocast + channels_last, through the same train_epoch on a device-resident image tensor.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

from models.classifiers import build_classifier
from models.objectives import TrainingModule, build_objective
from models.training import channel_stats, multistep_lr, normalize
from pipeline.registry import resolve_stage_config, run_stage
from shards.datasets import RealSplit, load_real
from stages.common.loop import Data, Recipe, train_epoch


class _NoBar:
    def update(self, n: int) -> None:
        pass


def _setup(model_name: str, classes: int, in_channels: int, sets: list[str]):
    from accelerate import Accelerator

    cfg = resolve_stage_config(
        "train", "digits", [f"model={model_name}", f"in_channels={in_channels}", *sets]
    )
    use_bf16 = torch.cuda.is_available()
    acc = Accelerator(cpu=not use_bf16, mixed_precision="bf16" if use_bf16 else "no")
    model = build_classifier(model_name, classes, in_channels)
    module = TrainingModule(model, build_objective("ce", classes)).to(acc.device)
    if acc.device.type == "cuda":
        module = module.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    module, opt = acc.prepare(module, opt)
    return cfg, acc, module, opt


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _compare(
    model_name: str, train: RealSplit, in_channels: int, epochs: int, sets: list[str]
) -> dict:
    """img/s of train_epoch on `train` vs the bare step on random tensors, interleaved, best of 3."""
    classes = len(train.class_names)
    cfg, acc, module, opt = _setup(model_name, classes, in_channels, sets)
    mean, std = channel_stats(train.images, in_channels)
    mean_t, std_t = torch.tensor(mean, device=acc.device), torch.tensor(std, device=acc.device)
    data = Data(train, train, mean_t, std_t, train.image_size)
    recipe = Recipe(
        key=(cfg.seed, "train"),
        epochs=epochs,
        batch_size=cfg.batch_size,
        lr=lambda e: multistep_lr(e, cfg.lr, cfg.milestones, cfg.lr_gamma),
        clip_norm=cfg.clip_norm,
        crop_pad=cfg.crop_pad,
        flip=cfg.flip,
    )
    steps = len(train) // cfg.batch_size
    n = steps * cfg.batch_size
    g = torch.Generator().manual_seed(0)
    x = normalize(
        torch.randint(
            0, 256, (cfg.batch_size, *train.images.shape[1:]), generator=g, dtype=torch.uint8
        ).to(acc.device),
        mean,
        std,
        channels_last=acc.device.type == "cuda",
    )
    y = torch.randint(0, classes, (cfg.batch_size,), generator=g).to(acc.device)
    params = list(acc.unwrap_model(module).model.parameters())

    def real_path() -> None:
        for e in range(epochs):
            train_epoch(recipe, e, acc, module, opt, data, _NoBar())

    def random_path() -> None:
        module.train()
        for _ in range(epochs * steps):
            opt.zero_grad(set_to_none=True)
            loss, _ = module(x=x, y=y)
            acc.backward(loss)
            acc.clip_grad_norm_(params, cfg.clip_norm)
            opt.step()
        loss.detach().item()  # one sync, as train_epoch's end-of-epoch reduce

    real_path(), random_path()  # warm-up (kernels, allocator)
    best = {"real": float("inf"), "random": float("inf")}
    for _ in range(3):
        for name, fn in (("real", real_path), ("random", random_path)):
            _sync()
            t0 = time.perf_counter()
            fn()
            _sync()
            best[name] = min(best[name], time.perf_counter() - t0)
    real_rate, rand_rate = (
        epochs * n / best["real"],
        epochs * steps * cfg.batch_size / best["random"],
    )
    return {
        "model": model_name,
        "images": f"{len(train)} x {train.images.shape[1]}x{train.images.shape[2]}",
        "batch": cfg.batch_size,
        "device": f"{acc.device.type}{' bf16' if acc.mixed_precision == 'bf16' else ''}, {torch.get_num_threads()} threads",
        "shard data path (img/s)": f"{real_rate:,.0f}",
        "random tensors (img/s)": f"{rand_rate:,.0f}",
        "ratio": f"{real_rate / rand_rate:.2f}",
    }


def run() -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="semix-bench-train-"))
    try:
        run_stage("prepare", "digits", [f"out={tmp}"])
        t0 = time.perf_counter()
        train = load_real(
            tmp / "digits" / "real" / "train", "cuda" if torch.cuda.is_available() else "cpu"
        )
        load_s = time.perf_counter() - t0
        rows = [
            _compare("digits-cnn", train, 1, epochs=3, sets=["batch_size=64"]),
            _compare(
                "resnet18",
                RealSplit(train.images[:256], train.labels[:256], train.class_names),
                3,
                epochs=1,
                sets=["batch_size=64"],
            ),
        ]
        notes = [
            f"Digits from real/train shards: loaded and decoded into device memory once in {load_s:.2f} s "
            "(not in the step rate). Ratio = shard data path / random tensors; goal >= 0.9.",
            "Both paths run the same prepared model, SGD and grad-norm clip; the data path adds the "
            "per-step index, on-device crop(pad) + normalise and the per-epoch reduce.",
            "On a shared 2-core machine set OMP_NUM_THREADS=1 when other jobs run: OpenMP's spinning "
            "second thread can make small CPU convolutions many times slower.",
        ]
        # ---------------- GPU section: runs only when CUDA is available -----------------
        if torch.cuda.is_available():
            g = torch.Generator().manual_seed(0)
            cifar = RealSplit(
                torch.randint(0, 256, (10240, 32, 32, 3), generator=g, dtype=torch.uint8).cuda(),
                torch.randint(0, 10, (10240,), generator=g).cuda(),
                tuple(str(c) for c in range(10)),
            )
            row = _compare(
                "resnet18", cifar, 3, epochs=2, sets=["batch_size=512", "crop_pad=4", "flip=true"]
            )
            row["images"] += " (CIFAR-size, GPU)"
            rows.append(row)
            notes.append(
                f"GPU row: {torch.cuda.get_device_name(0)}, bf16 autocast, channels_last, batch 512."
            )
        else:
            notes.append(
                "GPU section (ResNet-18 CIFAR img/s, bf16, channels_last) skipped: no CUDA device."
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "title": "Training step rate: shard data path vs random tensors",
        "rows": rows,
        "notes": notes,
    }
