"""Shard folders larger than memory: images decoded on access, everything else in memory.

Only pixels are large. A real split's labels, a mixed folder's series fields (classes, λ̂,
soft targets) and the series index are kilobytes to megabytes even for ImageNet-size sets, so
the streaming path keeps them in memory exactly as the in-memory path does and reads a PNG only
when a step asks for it:

    train = open_real(root / "real" / "train")          # RealSplit; images is an ImageStore
    train.images[idx]                                   # uint8 [B, H, W, 3], decoded now
    table = open_series_table(root / "mixed", names)    # SeriesTable; images a SeriesImages
    table.images[series, pos]                           # uint8 [B, 2, H, W, 3]

`ImageStore` and `SeriesImages` index like the uint8 tensors of `load_real` and
`load_series_table` and return the same bytes, so code written for the tensors (batching,
`channel_stats`, `collect_logits`) runs on them unchanged; `shards.prefetch` decodes ahead in
DataLoader workers for the training loop.

Integrity is the in-memory path's: at open, every shard is checked against its manifest record
(size always; sha256, streamed in 1 MiB blocks, unless hashing is off: `verify_sha256=0`) and
its sample count after grouping its members; every payload read also checks its own tar header
(`shards.offsets.read_member`), and PNGs decode through the same `decode_sample` with the same
one-line errors. Member offsets come from the writer's `.index/` (or a header scan for folders
without one). Only png, cls and json members exist; anything else (a pickle) is refused.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.io import sha256_file
from shards.datasets import (
    RealSplit,
    SeriesTable,
    check_image_size,
    check_real,
    mixed_manifest,
    series_table,
)
from shards.manifest import (
    Manifest,
    ShardError,
    check_digest,
    check_size,
    read_manifest,
    rerun_hint,
)
from shards.offsets import read_member, shard_members
from shards.reader import KNOWN_FIELDS, decode_sample, hashing

SMALL_FIELDS = ("cls", "json")  # read at open for the metadata; png is read on access


@dataclasses.dataclass
class _Columns:
    """Per-sample locations of one shard (or of a whole folder, concatenated)."""

    shard: np.ndarray  # int32 [n]: shard number in the manifest
    keys: np.ndarray  # bytes [n]: sample keys (checked against each member's header on read)
    png: np.ndarray  # int64 [n, 2]: offset, size of the png payload
    small: np.ndarray  # int64 [n, len(SMALL_FIELDS), 2]: offset, size (-1, -1 when absent)


def _shard_columns(folder: Path, number: int, manifest: Manifest, verify: bool) -> _Columns:
    """Check one shard against its record and group its members into samples."""
    rec, kind = manifest.shards[number], manifest.kind
    path = folder / rec.name
    if not path.is_file():
        raise ShardError(
            f"{path} is listed in the manifest but missing; {rerun_hint(kind, folder)}"
        )
    check_size(path, path.stat().st_size, rec, kind)
    if verify:
        check_digest(path, sha256_file(path), rec, kind)
    keys: list[str] = []
    where: list[dict[str, tuple[int, int]]] = []
    for name, offset, size in shard_members(folder, rec):
        key, _, ext = Path(name).name.partition(".")
        if ext not in KNOWN_FIELDS:
            raise ShardError(
                f"{path}: sample {key!r} has a member of type {ext!r}; semix only reads "
                f"{', '.join(KNOWN_FIELDS)} and never decodes other (e.g. pickled) members"
            )
        if not keys or keys[-1] != key:
            keys.append(key)
            where.append({})
        where[-1][ext] = (offset, size)
    if len(keys) != rec.count:
        raise ShardError(
            f"{path}: {len(keys)} samples, manifest says {rec.count} (truncated?); "
            f"{rerun_hint(kind, folder)}"
        )
    missing = [k for k, w in zip(keys, where) if "png" not in w]
    if missing:
        raise ShardError(f"{path}: sample {missing[0]!r} has no png image")
    absent = (-1, -1)
    return _Columns(
        shard=np.full(len(keys), number, dtype=np.int32),
        keys=np.array([k.encode() for k in keys], dtype=bytes),
        png=np.array([w["png"] for w in where], dtype=np.int64).reshape(-1, 2),
        small=np.array(
            [[w.get(f, absent) for f in SMALL_FIELDS] for w in where], dtype=np.int64
        ).reshape(-1, len(SMALL_FIELDS), 2),
    )


class ImageStore:
    """The images of a complete shard folder as a read-only uint8 array [N, H, W, 3] whose
    items are decoded when indexed (int, slice, or an integer array/tensor of any shape).

    Sample n is the n-th sample of the folder in manifest order, as in `load_split`. Holds no
    open files: each read opens the shards it needs (so DataLoader workers can share it).
    """

    def __init__(self, folder: Path, manifest: Manifest, columns: _Columns, image_shape: tuple):
        self.folder, self.manifest, self._c = Path(folder), manifest, columns
        self.image_shape = tuple(image_shape)

    @classmethod
    def open(cls, folder: Path, verify: bool | None = None) -> ImageStore:
        """Check every shard (size, sha256 unless hashing is off, count) and index its members."""
        folder = Path(folder)
        manifest = read_manifest(folder)
        verify = hashing(verify)
        parts = [_shard_columns(folder, i, manifest, verify) for i in range(len(manifest.shards))]
        if not parts or not sum(len(p.keys) for p in parts):
            raise ShardError(f"{folder} holds no samples")
        columns = _Columns(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in
                             dataclasses.fields(_Columns)))  # fmt: skip
        store = cls(folder, manifest, columns, ())
        for path, fd, _ in store._shard_reads(np.zeros(1, dtype=np.int64)):
            store.image_shape = store._decode(fd, path, 0).shape  # the folder's image size
        return store

    # ------------------------------------------------------------------ array-like view

    def __len__(self) -> int:
        return len(self._c.keys)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.image_shape)

    dtype = torch.uint8
    device = torch.device("cpu")

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.manifest.class_names

    def __getitem__(self, index: Any) -> torch.Tensor:
        if isinstance(index, slice):
            numbers = np.arange(*index.indices(len(self)), dtype=np.int64)
        elif isinstance(index, torch.Tensor):
            numbers = index.detach().cpu().numpy()
        else:
            numbers = np.asarray(index)
        if numbers.dtype == bool or not np.issubdtype(numbers.dtype, np.integer):
            raise TypeError(f"index an ImageStore with integers, got {numbers.dtype}")
        flat = numbers.astype(np.int64).reshape(-1)
        images = self.read(np.where(flat < 0, flat + len(self), flat))
        return torch.from_numpy(images.reshape(*numbers.shape, *self.image_shape))

    def head(self, n: int) -> ImageStore:
        """The first n samples (train's train_limit), without reading anything."""
        cut = _Columns(*(getattr(self._c, f.name)[:n] for f in dataclasses.fields(_Columns)))
        return ImageStore(self.folder, self.manifest, cut, self.image_shape)

    # ------------------------------------------------------------------ reads

    def _shard_reads(self, numbers: np.ndarray) -> Iterator[tuple[Path, int, np.ndarray]]:
        """(shard path, open fd, positions into `numbers`) per shard, reads in file order."""
        c = self._c
        order = np.lexsort((c.png[numbers, 0], c.shard[numbers]))
        shards = c.shard[numbers][order]
        cuts = np.flatnonzero(np.diff(shards)) + 1
        for group in np.split(order, cuts):
            if len(group):
                path = self.folder / self.manifest.shards[int(c.shard[numbers[group[0]]])].name
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise ShardError(f"cannot read shard {path}: {e.strerror or e}") from e
                try:
                    yield path, fd, group
                finally:
                    os.close(fd)

    def _decode(self, fd: int, path: Path, n: int) -> np.ndarray:
        key = self._c.keys[n].decode()
        offset, size = self._c.png[n]
        data = read_member(fd, path, f"{key}.png", int(offset), int(size), self.manifest.kind)
        image = decode_sample({"__key__": key, "__url__": str(path), "png": data})["image"]
        if self.image_shape and image.shape != self.image_shape:
            raise ShardError(
                f"{path}: sample {key!r} is {image.shape[1]}x{image.shape[0]}, the folder's "
                f"first image {self.image_shape[1]}x{self.image_shape[0]}"
            )
        return image

    def read(self, numbers: np.ndarray) -> np.ndarray:
        """uint8 [len(numbers), H, W, 3]: the decoded images of samples `numbers` (int64 1-D)."""
        numbers = np.asarray(numbers, dtype=np.int64)
        if numbers.size and (numbers.min() < 0 or numbers.max() >= len(self)):
            raise IndexError(f"sample numbers outside 0..{len(self) - 1} in {self.folder}")
        out = np.empty((len(numbers), *self.image_shape), dtype=np.uint8)
        for path, fd, group in self._shard_reads(numbers):
            for j in group:
                out[j] = self._decode(fd, path, int(numbers[j]))
        return out

    def samples(self) -> Iterator[dict[str, Any]]:
        """Every sample's small members decoded ({__key__, __url__, cls, meta}), in folder
        order, with "image" = the sample's number: the metadata pass of the open_* functions."""
        all_numbers = np.arange(len(self), dtype=np.int64)
        for path, fd, group in self._shard_reads(all_numbers):
            for n in group:  # a shard's samples, in file order
                key = self._c.keys[n].decode()
                raw: dict[str, Any] = {"__key__": key, "__url__": str(path)}
                for f, (offset, size) in zip(SMALL_FIELDS, self._c.small[n]):
                    if offset >= 0:
                        name = f"{key}.{f}"
                        raw[f] = read_member(fd, path, name, int(offset), int(size))
                yield {**decode_sample(raw), "image": int(n)}


class SeriesImages:
    """The images of a mixed folder's complete series as a uint8 array [S, K, H, W, 3], decoded
    when indexed: `members` [S, K] holds each series member's number in the ImageStore."""

    def __init__(self, store: ImageStore, members: torch.Tensor):
        self.store, self.members = store, members.cpu()

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.members.shape, *self.store.image_shape)

    dtype = torch.uint8

    def __len__(self) -> int:
        return int(self.members.shape[0])

    def __getitem__(self, index: Any) -> torch.Tensor:
        if isinstance(index, tuple):
            index = tuple(i.cpu() if isinstance(i, torch.Tensor) else i for i in index)
        elif isinstance(index, torch.Tensor):
            index = index.cpu()
        return self.store[self.members[index]]


# ---------------------------------------------------------------- the open_* functions


def open_real(
    folder: Path, device: str | torch.device = "cpu", verify: bool | None = None, limit: int = 0
) -> RealSplit:
    """`shards.datasets.load_real` for the streaming path: labels on `device`, images an
    ImageStore; the same checks (labels in range, square images). `limit` > 0: the split's
    first `limit` samples (train's train_limit), whose labels alone are read (every shard is
    still checked at open): 5,000 of Fashion-MNIST's 54,000 labels, not all of them."""
    store = ImageStore.open(folder, verify)
    if limit > 0:
        store = store.head(limit)
    labels = np.full(len(store), -1, dtype=np.int64)
    for s in store.samples():
        labels[s["image"]] = s.get("cls", -1)
    labels_t = torch.from_numpy(labels)
    check_real(folder, labels_t, store.shape, store.class_names)
    return RealSplit(store, labels_t.to(device), tuple(store.class_names))  # type: ignore[arg-type]


def open_series_table(
    folder: Path,
    class_names: Sequence[str] | None = None,
    device: str | torch.device = "cpu",
    image_size: int | None = None,
    verify: bool | None = None,
) -> SeriesTable:
    """`shards.datasets.load_series_table` for the streaming path: the same table (same
    series, order, fields, checks) with `images` a SeriesImages instead of pixels."""
    folder = Path(folder)
    mixed_manifest(folder, class_names)  # the class lists, before hashing anything
    store = ImageStore.open(folder, verify)
    table = series_table(folder, store.manifest, store.samples(), device)
    check_image_size(folder, store.image_shape[:2], image_size)
    return dataclasses.replace(table, images=SeriesImages(store, table.images))
