"""Read shard folders back: whole split in memory, or streaming through webdataset.

Both modes refuse a folder without `manifest.json` and decode only the fields semix
writes (png, cls, json). Members with any other extension, pickles in particular, are
an error: data from shards or the Hub is never unpickled.
"""

from __future__ import annotations

import io
import json
import random
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import webdataset as wds
from PIL import Image

from shards.manifest import Manifest, ShardError, read_manifest, verify_shards

KNOWN_FIELDS = ("png", "cls", "json")


def decode_png(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        # our PNGs are RGB already: skip the convert copy (a third of the decode time)
        return np.asarray(im if im.mode == "RGB" else im.convert("RGB"), dtype=np.uint8)


def decode_sample(raw: dict[str, Any]) -> dict[str, Any]:
    """webdataset raw sample (bytes per extension) -> {key, image, cls, meta}."""
    sample: dict[str, Any] = {"__key__": raw["__key__"], "__url__": raw.get("__url__", "?")}
    for field, value in raw.items():
        if field.startswith("__"):
            continue
        if field == "png":
            sample["image"] = decode_png(value)
        elif field == "cls":
            sample["cls"] = int(value.decode("ascii"))
        elif field == "json":
            sample["meta"] = json.loads(value.decode("utf-8"))
        else:
            url = raw.get("__url__", "?")
            raise ShardError(
                f"{url}: sample {raw['__key__']!r} has a member of type {field!r}; semix only "
                f"reads {', '.join(KNOWN_FIELDS)} and never decodes other (e.g. pickled) members"
            )
    return sample


def iter_shard(path: Path) -> Iterator[dict[str, Any]]:
    """Decoded samples of one tar, in file order. Raises ShardError naming a damaged shard."""
    try:
        with tarfile.open(path, mode="r:") as tar:
            current: dict[str, Any] = {}
            for member in tar:
                if not member.isfile():
                    continue
                key, _, ext = member.name.partition(".")
                if current and current["__key__"] != key:
                    yield decode_sample(current)
                    current = {}
                current.setdefault("__key__", key)
                current["__url__"] = str(path)
                data = tar.extractfile(member).read()
                if len(data) != member.size:
                    raise ShardError(
                        f"{path} is truncated inside {member.name!r}; rerun the stage that wrote it"
                    )
                current[ext] = data
            if current:
                yield decode_sample(current)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ShardError(f"{path} is damaged ({e}); rerun the stage that wrote it") from e


@dataclass
class Split:
    """A whole shard folder in memory: images uint8 [N, H, W, 3], labels int64 [N]."""

    images: torch.Tensor
    labels: torch.Tensor
    keys: list[str]
    meta: list[dict[str, Any]]
    manifest: Manifest

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.manifest.class_names

    def __len__(self) -> int:
        return len(self.keys)


def iter_folder(folder: Path, verify: bool = False) -> Iterator[dict[str, Any]]:
    """Every sample of a complete folder, shard by shard, in manifest order."""
    folder = Path(folder)
    manifest = verify_shards(folder) if verify else read_manifest(folder)
    for rec in manifest.shards:
        n = 0
        for sample in iter_shard(folder / rec.name):
            n += 1
            yield sample
        if n != rec.count:
            raise ShardError(
                f"{folder / rec.name}: {n} samples, manifest says {rec.count} (truncated?)"
            )


def load_split(folder: Path, verify: bool = False) -> Split:
    """Load a whole folder into memory (small datasets: CIFAR-size and below)."""
    manifest = verify_shards(folder) if verify else read_manifest(folder)
    images, labels, keys, meta = [], [], [], []
    for s in iter_folder(folder):
        if "image" not in s:
            raise ShardError(f"{s['__url__']}: sample {s['__key__']!r} has no png image")
        images.append(s["image"])
        labels.append(s.get("cls", -1))
        keys.append(s["__key__"])
        meta.append(s.get("meta", {}))
    if not images:
        raise ShardError(f"{folder} holds no samples")
    shapes = {im.shape for im in images}
    if len(shapes) != 1:
        raise ShardError(f"{folder}: images of different sizes {sorted(shapes)}")
    return Split(
        images=torch.from_numpy(np.stack(images)),
        labels=torch.tensor(labels, dtype=torch.int64),
        keys=keys,
        meta=meta,
        manifest=manifest,
    )


def stream(
    folder: Path,
    *,
    shuffle_buffer: int = 0,
    seed: int = 0,
    shuffle_shards: bool = False,
) -> wds.WebDataset:
    """Streaming reader for large folders: shards split by node (rank) and by worker.

    Returns a webdataset pipeline of decoded samples; wrap it in a torch DataLoader.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    urls = [str(folder / rec.name) for rec in manifest.shards]
    ds = wds.WebDataset(
        urls,
        nodesplitter=wds.split_by_node,
        workersplitter=wds.split_by_worker,
        shardshuffle=seed if shuffle_shards else False,
        empty_check=False,
    ).map(decode_sample)
    if shuffle_buffer > 0:
        ds = ds.shuffle(shuffle_buffer, rng=random.Random(seed))
    return ds
