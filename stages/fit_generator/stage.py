"""fit-generator's run: real/train in, the generator folder out (its files: the package's
docstring, stages/fit_generator/__init__.py).

The judges of fidelity are made on the main process; every process trains
(stages/fit_generator/training.py); the main process then writes the weights, the fidelity curve,
the sample grid at the chosen guidance, and the manifest last, once the checkpoints are gone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from accelerate import PartialState

from core.io import sha256_file, writing
from core.launch import Processes
from core.logs import log
from core.version import code_version
from models.generators import UNET_PRESETS, save_unet
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
from stages.common.fidelity import sample_grid
from stages.common.loop import accelerate_precision
from stages.configs.fit_generator import Config
from stages.fit_generator.recheck import fidelity_check, recheck, recheck_fields
from stages.fit_generator.training import CHECKPOINTS, noise_scheduler, train

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


def run(cfg: Config) -> Path:
    """Fit the generator of `cfg.root` (a complete one only reads); returns its folder."""
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
    precision = accelerate_precision(cfg.precision, procs.device.type == "cpu")
    log.info(
        "fit-generator: %s UNet, %d classes, %d images, %d steps x %d, %s, %d threads, "
        "label dropout %g -> %s",
        cfg.unet, len(names), len(images), cfg.train_steps, cfg.batch_size,
        "fp32" if precision == "no" else precision, torch.get_num_threads(), cfg.label_dropout,
        folder,
    )  # fmt: skip

    # 2. The judges of fidelity (main process), then train (every process)
    check = None
    if procs.is_main:
        check = fidelity_check(cfg, names, procs.device)
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
        folder, names, state.device, guidance, cfg.preview.sample_steps, cfg.preview.per_class, cfg.seed,
        clip,
    )  # fmt: skip

    # 4. Manifest last, then the training checkpoints go
    info = {
        "backend": "unet",
        "unet": cfg.unet,
        "image_size": size,
        "num_classes": len(names),
        "class_names": list(names),
        "train_steps": cfg.train_steps,
        "train_images": len(images),
        "epochs": round(cfg.train_steps * cfg.batch_size * state.num_processes / len(images), 2),
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
