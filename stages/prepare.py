"""prepare: a real dataset -> runs/<classes>/real/{train,val,test}/ as WebDataset shards.

    python -m pipeline prepare --preset digits
    python -m pipeline prepare --preset cifar100 --set data_dir=/data/cifar-100-python.tar.gz

Every split folder gets shards, completion records and, last, its manifest. Reruns skip
complete shards, so a killed run resumes to the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from core.logs import log, progress
from core.runtime import code_version, make_generator
from shards.manifest import ShardError
from shards.sources import Source, SplitSource
from shards.writer import ShardFolder, completed, write_config
from stages.configs.prepare import Config
from stages.presets import reader

SPLITS = ("train", "val", "test")


def stratified_split(
    labels: np.ndarray, fraction: float, generator: torch.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held_out) index arrays: `fraction` of every class held out, seeded, sorted."""
    held = []
    for k in np.unique(labels):
        idx = np.flatnonzero(labels == k)
        perm = torch.randperm(len(idx), generator=generator).numpy()
        # at least one per class when holding out anything, so tiny datasets get a usable val
        n_held = max(1, round(fraction * len(idx))) if fraction > 0 and len(idx) > 1 else 0
        held.append(idx[perm[:n_held]])
    held_out = np.sort(np.concatenate(held)) if held else np.zeros(0, dtype=np.int64)
    kept = np.setdiff1d(np.arange(len(labels)), held_out)
    return kept, held_out


def plan_splits(source: Source, cfg: Config) -> dict[str, tuple[SplitSource, np.ndarray]]:
    """split name -> (source split, indices into it). Deterministic given the seed."""
    train = source.splits["train"]
    train_idx = np.arange(len(train))
    if "test" in source.splits:
        test = (source.splits["test"], np.arange(len(source.splits["test"])))
    else:
        keep, held = stratified_split(
            train.labels, cfg.test_fraction, make_generator(cfg.seed, "test-split")
        )
        train_idx, test = keep, (train, held)
    keep, held = stratified_split(
        train.labels[train_idx], cfg.val_fraction, make_generator(cfg.seed, "val-split")
    )
    return {"train": (train, train_idx[keep]), "val": (train, train_idx[held]), "test": test}


def _squash(image: np.ndarray, size: int) -> np.ndarray:
    """Both sides to `size` (bicubic): the aspect ratio is not kept."""
    return np.asarray(Image.fromarray(image).resize((size, size), Image.Resampling.BICUBIC))


def _center_crop(image: np.ndarray, size: int) -> np.ndarray:
    """The shorter side to `size` (bicubic, PIL's antialiasing), then the central size x size:
    the aspect ratio is kept (ImageNet's photos are mostly 4:3)."""
    im = Image.fromarray(image)
    scale = size / min(im.size)
    w, h = max(size, round(im.width * scale)), max(size, round(im.height * scale))
    im = im.resize((w, h), Image.Resampling.BICUBIC)
    left, top = (w - size) // 2, (h - size) // 2
    return np.asarray(im.crop((left, top, left + size, top + size)))


RESIZERS = {"squash": _squash, "center-crop": _center_crop}


def _samples(
    split: str, src: SplitSource, indices: np.ndarray, size: int, resize: str, bar
) -> Iterator[dict]:
    """Sample dicts for the writer; every image comes out size x size RGB or we stop, naming it.
    `resize` names a RESIZERS entry, "" = refuse images of another size."""
    for i in indices:
        image = src.get(int(i))
        if image.ndim != 3 or image.shape[2] != 3:
            raise ShardError(
                f"{src.describe(int(i))}: expected an RGB image, got shape {image.shape}"
            )
        if image.shape[:2] != (size, size):
            if not resize:
                raise ShardError(
                    f"{src.describe(int(i))} is {image.shape[1]}x{image.shape[0]}, others {size}x{size}: "
                    "set image_size=N to resize everything"
                )
            image = RESIZERS[resize](image, size)
        bar.update(1)
        # key = split + index into the source split: stable, unique, no dots
        yield {"__key__": f"{split}_{int(i):07d}", "png": image, "cls": int(src.labels[i])}


def already_complete(cfg: Config, real: Path) -> bool:
    """Every split has its manifest (and the config matches): a rerun only reads, so it works on
    read-only media and without the source dataset at hand."""
    if not all(completed(real / split) for split in SPLITS):
        return False
    write_config(real, cfg.recorded())  # compares only: refuses another config
    log.info("prepare: %s is complete already", real)
    return True


def run(cfg: Config) -> Path:
    real = cfg.root / "real"
    if already_complete(cfg, real):
        return real
    # 1. Load the source (may fail with a one-line message naming what is missing).
    source: Source = reader(cfg.source)(cfg)  # each preset says how its data are read
    write_config(real, cfg.recorded())
    splits = plan_splits(source, cfg)
    log.info(
        "prepare %s: %d classes, %s -> %s",
        cfg.source,
        len(source.class_names),
        ", ".join(f"{k} {len(v[1])}" for k, v in splits.items()),
        real,
    )
    # 2. Write every split shard by shard, skipping complete shards (resume).
    size = cfg.image_size or source.splits["train"].get(0).shape[0]
    total = sum(len(idx) for _, idx in splits.values())
    with progress(range(total), total=total, desc="prepare", unit="img") as bar:
        for name, (src, indices) in splits.items():
            folder = ShardFolder(real / name, prefix=name)
            chunks = [
                indices[i : i + cfg.shard_size] for i in range(0, len(indices), cfg.shard_size)
            ]
            for k, chunk in enumerate(chunks):
                if folder.done(k) is not None:
                    bar.update(len(chunk))
                    continue
                resize = cfg.resize if cfg.image_size > 0 else ""
                folder.write(k, _samples(name, src, chunk, size, resize, bar))
            # 3. Manifest last: the split is complete only now.
            folder.finish(
                len(chunks),
                kind="real",
                class_names=source.class_names,
                code_version=code_version(),
                info={"split": name, "source": cfg.source, "image_size": size},
            )
    return real
