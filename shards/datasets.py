"""Shard folders -> tensors for training and evaluation (small datasets, held in memory).

- `load_real(folder)`: one real split as uint8 images [N, H, W, 3] + labels [N], on a device.
- `load_series_table(mixed, class_names)`: mixed/ as a table of *complete* series, the layout
  CSM training samples from (docs/methods.md §3): images [S, K, H, W, 3], classes [S, 2] and per-member
  lambda_hat / soft (= t_a) / alpha [S, K]; for k-way series (json `weights`, generate's
  mix_classes = k ≥ 3) classes [S, k] and lambda_hat / soft / weights [S, K, k]. Series missing a
  member are dropped (counted).

Both refuse missing or incomplete folders (no manifest.json) through `shards.reader`, and the
series table refuses a mixed/ folder whose class list differs from the real one: class ids
would silently mean different things.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shards.manifest import MANIFEST, Manifest, ShardError, read_manifest, rerun_hint
from shards.reader import iter_folder, load_split


@dataclass
class RealSplit:
    """images uint8 [N, H, W, 3] and labels int64 [N] (same device), class names."""

    images: torch.Tensor
    labels: torch.Tensor
    class_names: tuple[str, ...]

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def image_size(self) -> int:
        return int(self.images.shape[1])


def load_real(
    folder: Path, device: str | torch.device = "cpu", verify: bool | None = None
) -> RealSplit:
    """A prepared real split (real/train, real/val, real/test) into memory on `device`; every
    shard checked against the manifest first (`verify`: sha256 too; None = the default)."""
    split = load_split(Path(folder), verify)
    check_real(folder, split.labels, tuple(split.images.shape), split.class_names)
    return RealSplit(split.images.to(device), split.labels.to(device), tuple(split.class_names))


def check_real(
    folder: Path, labels: torch.Tensor, shape: tuple[int, ...], names: Sequence[str]
) -> None:
    """Labels in 0..C-1 and square images [N, H, H, 3]: what every real split must hold (also
    checked by the streaming path, `shards.store.open_real`)."""
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= len(names)):
        raise ShardError(class_ids_error(folder, (int(labels.min()), int(labels.max())), names))
    if shape[1] != shape[2]:
        raise ShardError(f"{folder}: images must be square, got {tuple(shape[1:3])}")


def class_ids_error(folder: Path, ids: tuple[int, int], names: Sequence[str]) -> str:
    """The shards hold class ids (lowest, highest) that `names` (the manifest's) do not cover: the
    manifest lists fewer class names than its shards use (edited, or from another folder)."""
    low, high = ids
    what = f"class id {high}" if high >= len(names) else f"class id {low}"
    return (
        f"{Path(folder) / MANIFEST} lists {len(names)} class names (ids 0..{len(names) - 1}) "
        f"but its shards hold {what}: the manifest was edited or belongs to another folder; "
        f"restore it, or {rerun_hint('', Path(folder))}"
    )


def check_same_classes(what: str, names: Sequence[str], reference: Sequence[str], ref: str) -> None:
    if tuple(names) != tuple(reference):
        raise ShardError(
            f"{what} has classes {list(names)[:5]}... ({len(names)}), {ref} has "
            f"{list(reference)[:5]}... ({len(reference)}): the class lists must be identical"
        )


@dataclass
class SeriesTable:
    """Complete series of a mixed/ folder, member k at index k (position order)."""

    images: torch.Tensor  # uint8 [S, K, H, W, 3] (streaming path: shards.store.SeriesImages)
    classes: torch.Tensor  # int64 [S, k]: (a, b) for k = 2
    lambda_hat: torch.Tensor  # float32 [S, K]: re-annotated weight of class a (k ≥ 3: [S, K, k])
    soft: torch.Tensor  # float32 [S, K]: stored target t_a, t_b = 1 - t_a (k ≥ 3: [S, K, k])
    alpha: torch.Tensor  # float32 [S, K]: generation weight of class a (k ≥ 3: weights [S, K, k])
    series_ids: torch.Tensor  # int64 [S]
    class_names: tuple[str, ...]
    dropped: int  # incomplete series left out

    def __len__(self) -> int:
        return int(self.classes.shape[0])

    @property
    def members(self) -> int:
        return int(self.images.shape[1])

    @property
    def mix_classes(self) -> int:
        return int(self.classes.shape[1])


def load_series_table(
    folder: Path,
    class_names: Sequence[str] | None = None,
    device: str | torch.device = "cpu",
    image_size: int | None = None,
    verify: bool | None = None,
) -> SeriesTable:
    """mixed/ -> SeriesTable. `class_names` (the real ones) and `image_size` are checked if given.

    K comes from the manifest's `info.alphas` when present, else from the longest series. A
    series is complete when it holds each position 0..K−1 exactly once.
    """
    folder = Path(folder)
    manifest = mixed_manifest(folder, class_names)
    return series_table(folder, manifest, iter_folder(folder, verify), device, image_size)


def mixed_manifest(folder: Path, class_names: Sequence[str] | None) -> Manifest:
    """mixed/'s manifest, its class list checked against the real one when given."""
    manifest = read_manifest(folder)
    if class_names is not None:
        check_same_classes(f"mixed folder {folder}", manifest.class_names, class_names, "real/")
    return manifest


def check_image_size(folder: Path, height_width: Sequence[int], image_size: int | None) -> None:
    """Mixed images must have the real ones' size (`image_size`, square; None: not checked)."""
    h, w = height_width
    if image_size is not None and (h, w) != (image_size, image_size):
        raise ShardError(
            f"{folder}: mixed images are {w}x{h}, real images {image_size}x{image_size}; "
            "regenerate at the dataset resolution"
        )


def series_table(
    folder: Path,
    manifest: Manifest,
    samples: Iterable[dict[str, Any]],
    device: str | torch.device = "cpu",
    image_size: int | None = None,
) -> SeriesTable:
    """The SeriesTable of decoded mixed samples. A sample's "image" is its pixels, or (the
    streaming path, `shards.store.open_series_table`) its number in the folder: `images` is
    then int64 [S, K], the numbers of each series' members, and the caller checks the size."""
    by_series: dict[int, dict[int, tuple]] = {}
    for s in samples:
        meta = s.get("meta", {})
        try:
            sid, pos = int(meta["series"]), int(meta["position"])
            classes = tuple(int(c) for c in meta["classes"])
            if "weights" in meta:  # k-way: lists of length k
                record = (
                    s["image"],
                    classes,
                    [float(v) for v in meta["lambda_hat"]],
                    [float(v) for v in meta["soft"]],
                    [float(v) for v in meta["weights"]],
                )
                if not len(classes) == len(record[2]) == len(record[3]) == len(record[4]):
                    raise ValueError("classes, lambda_hat, soft, weights differ in length")
            else:
                record = (
                    s["image"],
                    classes,
                    float(meta["lambda_hat"]),
                    float(meta["soft"][0]),
                    float(meta["alpha"]),
                )
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ShardError(
                f"{s['__url__']}: sample {s['__key__']!r} lacks mixed fields (series, position, "
                f"classes, lambda_hat, soft, alpha or weights, png): {e!r}; is {folder} a mixed/ "
                "folder?"
            ) from e
        if pos in by_series.setdefault(sid, {}):
            raise ShardError(f"{folder}: series {sid} has position {pos} twice")
        by_series[sid][pos] = record
    if not by_series:
        raise ShardError(f"{folder} holds no samples")
    alphas = manifest.info.get("alphas") or manifest.info.get("weights")  # 2-way / k-way
    k = len(alphas) if alphas else max(len(m) for m in by_series.values())
    complete = sorted(sid for sid, m in by_series.items() if sorted(m) == list(range(k)))
    if not complete:
        raise ShardError(f"{folder}: no complete series of {k} members")
    rows = [[by_series[sid][p] for p in range(k)] for sid in complete]
    images = np.stack([np.stack([r[0] for r in row]) for row in rows])
    if images.ndim == 5:  # pixels, else sample numbers [S, K]
        check_image_size(folder, images.shape[2:4], image_size)
    if len({len(row[0][1]) for row in rows}) != 1:
        raise ShardError(f"{folder}: series mix different numbers of classes")
    classes = torch.tensor([row[0][1] for row in rows], dtype=torch.int64)
    if classes.numel() and (
        int(classes.min()) < 0 or int(classes.max()) >= len(manifest.class_names)
    ):
        ids = (int(classes.min()), int(classes.max()))
        raise ShardError(class_ids_error(folder, ids, manifest.class_names))

    def field(i: int) -> torch.Tensor:
        return torch.tensor([[m[i] for m in row] for row in rows], dtype=torch.float32)

    return SeriesTable(
        images=torch.from_numpy(images).to(device),
        classes=classes.to(device),
        lambda_hat=field(2).to(device),
        soft=field(3).to(device),
        alpha=field(4).to(device),
        series_ids=torch.tensor(complete, dtype=torch.int64),
        class_names=tuple(manifest.class_names),
        dropped=len(by_series) - len(complete),
    )


# Fields of every mixed sample's json (docs/architecture.md, Shard folders) and their JSON types: Hugging Face
# `datasets` infers one feature set from them, and train reads lambda_hat / soft / alpha.
MIXED_FIELDS: dict[str, type | tuple[type, ...]] = {
    "series": int,
    "position": int,
    "classes": list,
    "names": list,
    "alpha": (int, float),
    "seed": int,
    "lambda_hat": (int, float),
    "soft": list,
}
# k-way samples (generate's mix_classes = k ≥ 3): lists of length k instead of alpha and scalar λ̂
KWAY_FIELDS: dict[str, type | tuple[type, ...]] = {
    "series": int,
    "position": int,
    "classes": list,
    "names": list,
    "weights": list,
    "seed": int,
    "lambda_hat": list,
    "soft": list,
}


def check_mixed_sample(sample: dict) -> None:
    """A decoded mixed sample has its png, cls and every field of MIXED_FIELDS, well typed."""
    where = f"{sample['__url__']}: sample {sample['__key__']!r}"
    missing = [f for f in ("image", "cls", "meta") if f not in sample]
    if missing:
        raise ShardError(f"{where} lacks {missing}; is this a mixed/ folder? rerun annotate")
    meta = sample["meta"]
    fields = KWAY_FIELDS if "weights" in meta else MIXED_FIELDS
    bad = [
        name
        for name, kind in fields.items()
        if not isinstance(meta.get(name), kind) or isinstance(meta.get(name), bool)
    ]
    lists = [f for f, kind in fields.items() if kind is list and f not in bad]
    k = len(meta["classes"]) if "classes" in lists else 2
    same_k = k >= 2 and all(len(meta[f]) == k for f in lists)
    if "weights" not in meta:
        same_k = k == 2 and same_k
    if bad or not same_k:
        what = "classes/names/soft of length 2" if fields is MIXED_FIELDS else "lists of length k"
        raise ShardError(
            f"{where}: json field(s) {bad or [what]} missing or malformed; rerun annotate"
        )
