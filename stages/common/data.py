"""What train and evaluate read, through the data path `shards.datapath` chose for them.

    path = choose_path(cfg, [real / "train", real / "val"], device)   # decided on the main process
    train = open_split(real / "train", path, device)                  # RealSplit either way
    mean, std = statistics(train, channels=3, cfg=cfg)
    val = sequential(open_split(real / "val", path, device), chunk=512, cfg=cfg)
    table = open_series(root / "mixed", path, train.class_names, device, train.image_size)

On the "memory" path every image is decoded once into a uint8 tensor on the device
(`shards.datasets.load_real` / `load_series_table`); on the "stream" path the images stay in
their shards (`shards.store.ImageStore` / `SeriesImages`) and DataLoader workers decode them ahead
of use (`shards.prefetch`), while labels, series fields and targets are in memory on both. The
two give the same bytes, so a stage's results do not depend on the path (tests/test_train.py).

The config's `data` section (shards.datapath.Data: train, finetune and evaluate hold one;
none of it is part of a run's identity):

    data.path = "auto" | "memory" | "stream"   auto: memory iff the decoded size fits the budget
    data.memory_budget_gb = 0                  0 = derived from this machine's free memory
    data.stream_workers = 2                    DataLoader workers per process (stream only)
    data.stream_prefetch = 2                   steps (or slices) each worker decodes ahead
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from core.launch import share_from_main
from models.training import channel_stats, stats_chunk
from shards.datapath import Data, DataPathChoice, choose_data_path
from shards.datasets import RealSplit, SeriesTable, load_real, load_series_table
from shards.prefetch import PixelSource, SequentialImages
from shards.store import ImageStore, open_real, open_series_table


class DataFields(Protocol):
    data: Data  # the config's section of how images are read


def choose_path(
    cfg: DataFields, folders: Sequence[Path], device: torch.device, accelerator: Any = None
) -> DataPathChoice:
    """The path for `folders` (everything the stage would hold decoded), chosen once on the main
    process and sent to the others, so all ranks of a run read the same way. (Stages log
    `describe()` once the data opened: a bad input's error stays the only line.)"""
    choice = None
    if accelerator is None or accelerator.is_main_process:
        choice = choose_data_path(cfg.data.path, folders, cfg.data.memory_budget_gb, device)
    share = share_from_main(accelerator) if accelerator is not None else None
    return share(choice) if share else choice


def open_split(folder: Path, choice: DataPathChoice, device: torch.device) -> RealSplit:
    """A real split: decoded on the device (memory) or an ImageStore with labels on it (stream)."""
    if choice.path == "memory":
        return load_real(folder, device)
    return open_real(folder, device)


def open_series(
    folder: Path,
    choice: DataPathChoice,
    class_names: Sequence[str],
    device: torch.device,
    image_size: int,
) -> SeriesTable:
    """A mixed folder's complete series: pixels on the device (memory) or a SeriesImages."""
    if choice.path == "memory":
        return load_series_table(folder, class_names, device, image_size=image_size)
    return open_series_table(folder, class_names, device, image_size=image_size)


def head(split: RealSplit, n: int) -> RealSplit:
    """The first n samples (train_limit), on either path, reading nothing."""
    images = split.images
    images = images.head(n) if isinstance(images, ImageStore) else images[:n]
    return RealSplit(images, split.labels[:n], split.class_names)


def open_head(folder: Path, n: int, choice: DataPathChoice, device: torch.device) -> RealSplit:
    """`head(open_split(...), n)`, decoding only those n on the memory path (the same bytes:
    an ImageStore's items are `load_real`'s; 5,000 of Fashion-MNIST's 54,000 in a tenth of
    the time)."""
    split = open_real(folder, device, limit=n)  # labels of those n only
    if choice.path == "memory":
        split = RealSplit(split.images[:].to(device), split.labels, split.class_names)
    return split


def sequential(split: RealSplit, chunk: int, cfg: DataFields) -> RealSplit:
    """The split for in-order passes of `chunk` images (validation, evaluation logits): on the
    stream path, workers decode the next slices ahead. Workers start here: call before the
    model is built, and `close` the split when done."""
    if not isinstance(split.images, ImageStore):
        return split
    ahead = SequentialImages(split.images, chunk, cfg.data.stream_workers, cfg.data.stream_prefetch)
    return RealSplit(ahead, split.labels, split.class_names)  # type: ignore[arg-type]


def statistics(split: RealSplit, channels: int, cfg: DataFields) -> tuple[list[float], list[float]]:
    """`channel_stats` of a split (the run's normalisation): one pass, prefetched on stream."""
    chunk = stats_chunk(tuple(split.images.shape[1:]))
    if not isinstance(split.images, ImageStore):
        return channel_stats(split.images, channels, chunk)
    ahead = sequential(split, chunk, cfg)
    try:
        return channel_stats(ahead.images, channels, chunk)
    finally:
        close(ahead)


def pixel_source(
    train: RealSplit, series: Any, mixes_rows: bool, accelerator: Any, cfg: DataFields
) -> PixelSource:
    """Where the training steps' pixels come from: this rank's rows of each planned step (or
    every row when the objective mixes rows: mixup), indexed or decoded ahead by workers.
    Workers start here: call before the model is built when possible."""
    rank, world = accelerator.process_index, accelerator.num_processes
    return PixelSource(
        train.images,
        series,
        *((0, 1) if mixes_rows else (rank, world)),
        workers=cfg.data.stream_workers,
        prefetch=cfg.data.stream_prefetch,
        device=accelerator.device,
    )


def close(*splits: Any) -> None:
    """Let the workers of streamed splits (and pixel sources) go; in-memory ones have none."""
    for s in splits:
        images = getattr(s, "images", s)
        if hasattr(images, "close"):
            images.close()
