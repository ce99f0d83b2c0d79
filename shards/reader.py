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


_BLOCK = 512


class _NotPlainUstar(Exception):
    """A member the fast path does not handle (pax/GNU headers, links, ...): use tarfile."""


def _octal(field: bytes) -> int:
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def _fast_members(data: bytes, path: Path) -> Iterator[tuple[str, bytes]]:
    """(name, payload) of a plain ustar archive, parsed straight from the bytes.

    Our shards are plain ustar (short names, regular files only), and for small images the
    stdlib's tarfile spends more time on headers than PIL spends decoding: this path reads
    them ~7x faster. Anything unusual raises _NotPlainUstar and the caller falls back.
    """
    off = 0
    while off + _BLOCK <= len(data):
        header = data[off : off + _BLOCK]
        if header.count(0) == _BLOCK:
            return  # end-of-archive marker
        if _octal(header[148:156]) != sum(header[:148]) + 8 * 32 + sum(header[156:]):
            raise ShardError(f"{path} is damaged (bad tar header checksum at byte {off})")
        if header[156:157] not in (b"0", b"\0") or header[345:346] != b"\0":
            raise _NotPlainUstar
        name = header[:100].split(b"\0", 1)[0].decode("utf-8")
        size = _octal(header[124:136])
        start = off + _BLOCK
        if start + size > len(data):
            raise ShardError(f"{path} is truncated inside {name!r}; rerun the stage that wrote it")
        yield name, data[start : start + size]
        off = start + -(-size // _BLOCK) * _BLOCK
    raise ShardError(
        f"{path} is truncated (no end-of-archive marker); rerun the stage that wrote it"
    )


def _tarfile_members(data: bytes, path: Path) -> Iterator[tuple[str, bytes]]:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                if member.isfile():
                    payload = tar.extractfile(member).read()
                    if len(payload) != member.size:
                        raise ShardError(f"{path} is truncated inside {member.name!r}")
                    yield member.name, payload
    except (tarfile.TarError, EOFError) as e:
        raise ShardError(f"{path} is damaged ({e}); rerun the stage that wrote it") from e


def read_raw_shard(path: Path) -> list[dict[str, Any]]:
    """Undecoded samples of one tar, in file order: {__key__, __url__, ext: bytes, ...}.

    For stages that pass members through unchanged (annotate copies the series PNG bytes).
    """
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ShardError(f"cannot read shard {path}: {e}") from e
    try:
        members = list(_fast_members(data, path))
    except _NotPlainUstar:
        members = list(_tarfile_members(data, path))
    samples: list[dict[str, Any]] = []
    for name, payload in members:
        key, _, ext = Path(name).name.partition(".")
        if not samples or samples[-1]["__key__"] != key:
            samples.append({"__key__": key, "__url__": str(path)})
        samples[-1][ext] = payload
    return samples


def iter_shard(path: Path) -> Iterator[dict[str, Any]]:
    """Decoded samples of one tar, in file order. Raises ShardError naming a damaged shard."""
    for raw in read_raw_shard(path):
        yield decode_sample(raw)


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
