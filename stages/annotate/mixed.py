"""annotate, part 2: one series shard -> one mixed shard (docs/methods.md §2).

Mixed shard i is series shard i with the same keys and the very same PNG bytes (copied, never
re-encoded); only `json` (+ λ̂, soft) and `cls` change. Each shard is computed alone, so its
bytes depend on neither the number of workers, the rank nor the resume point.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from models.annotation import annotate
from models.simplex import annotate_simplex
from shards.manifest import ShardError, ShardRecord
from shards.reader import decode_sample, read_raw_shard
from shards.writer import ShardFolder
from stages.annotate.report import Columns, columns
from stages.configs.annotate import Config


def load_series_shard(path: Path, rec: ShardRecord) -> tuple[list[dict], list[dict], np.ndarray]:
    """-> (raw samples, their json, images uint8 [n, H, W, 3])."""
    raw = read_raw_shard(path, rec, kind="series")  # size, sha256 and count checked
    if not raw:
        raise ShardError(f"{path} holds no samples; rerun generate")
    decoded = [decode_sample(r) for r in raw]  # refuses foreign members (never unpickles)
    meta = [d.get("meta", {}) for d in decoded]
    mix = "weights" if "weights" in meta[0] else "alpha"  # k-way or 2-way series
    missing = {mix, "classes", "series", "position"} - set(meta[0])
    if missing:
        raise ShardError(f"{path}: series samples lack the fields {sorted(missing)}")
    return raw, meta, np.stack([d["image"] for d in decoded])


def label(cfg: Config, meta: list[dict], images: np.ndarray, encoder, prototypes) -> list[dict]:
    """Series json -> mixed json: + lambda_hat and soft [t_a, t_b] (docs/methods.md §2); k-way series:
    lambda_hat and soft of length k."""
    if "weights" in meta[0]:
        return label_kway(cfg, meta, images, encoder, prototypes)
    alpha = torch.tensor([m["alpha"] for m in meta], dtype=torch.float64)
    pairs = torch.tensor([m["classes"] for m in meta], dtype=torch.int64)
    features = encoder.encode(torch.as_tensor(images)) if encoder is not None else None
    lam, t_a = annotate(
        cfg.annotator, features, alpha, pairs[:, 0], pairs[:, 1], prototypes, cfg.sharpening
    )
    return [
        {**m, "lambda_hat": lam_i, "soft": [t, 1.0 - t]}
        for m, lam_i, t in zip(meta, lam.tolist(), t_a.tolist())
    ]


def label_kway(cfg: Config, meta: list[dict], images: np.ndarray, encoder, prototypes) -> list:
    weights = torch.tensor([m["weights"] for m in meta], dtype=torch.float64)
    classes = torch.tensor([m["classes"] for m in meta], dtype=torch.int64)
    features = encoder.encode(torch.as_tensor(images)) if encoder is not None else None
    lam, t = annotate_simplex(cfg.annotator, features, weights, classes, prototypes, cfg.sharpening)
    return [
        {**m, "lambda_hat": lam_i, "soft": t_i}
        for m, lam_i, t_i in zip(meta, lam.tolist(), t.tolist())
    ]


def dominant(f: dict) -> int:
    """cls of a mixed sample: argmax of soft (2-way: a if t_a >= 0.5; first class on ties)."""
    soft = f["soft"]
    if len(soft) == 2:
        return f["classes"][0] if soft[0] >= 0.5 else f["classes"][1]
    return f["classes"][max(range(len(soft)), key=lambda i: (soft[i], -i))]


def mixed_samples(raw: list[dict], fields: list[dict]) -> list[dict]:
    """Mixed samples with the series PNG bytes passed through (never re-encoded)."""
    return [
        {"__key__": r["__key__"], "png": r["png"], "cls": dominant(f), "json": f}
        for r, f in zip(raw, fields)
    ]


def _as_is(item):
    return item


class SeriesShards(torch.utils.data.Dataset):
    """Item n = (shard index, raw samples, json, images) of the n-th shard to annotate."""

    def __init__(self, series: Path, shards: dict[int, ShardRecord]):
        self.series, self.shards = series, list(shards.items())

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, n: int):
        i, rec = self.shards[n]
        return (i, *load_series_shard(self.series / rec.name, rec))


def annotate_shards(cfg, shards, series: Path, folder: ShardFolder, encoder, prototypes, bar):
    """Annotate series shards {index: record} in order -> {index: the report's columns of its
    mixed json} (converted per shard: rank 0 never holds per-image dicts of all its shards).

    With `workers` > 0, worker processes read and decode the next shards while this process
    encodes and writes (processes, not threads: tar parsing is Python code that holds the GIL,
    which the encoder's torch ops need between kernels). Each shard is computed alone, so its
    bytes depend on neither workers, rank nor resume point.
    """
    out: dict[int, Columns] = {}
    # collate_fn=_as_is: the default would walk every nested list converting numpy -> torch
    loader = torch.utils.data.DataLoader(
        SeriesShards(series, shards), batch_size=None, num_workers=cfg.workers, collate_fn=_as_is
    )
    for i, raw, meta, images in loader:
        fields = label(cfg, meta, images, encoder, prototypes)
        folder.write(i, mixed_samples(raw, fields))
        out[i] = columns(fields)
        bar.update(len(raw))
    return out
