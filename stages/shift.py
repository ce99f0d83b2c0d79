"""shift: real/test -> runs/<classes>/shift/test-c/, the test split corrupted at five severities
(Fashion-MNIST-C for `--preset fashion-mnist`), in the layout evaluate reads (CIFAR-C's).

    python -m pipeline shift --preset fashion-mnist
    python -m pipeline evaluate --preset fashion-mnist --set corruptions=runs/fashion-mnist/shift/test-c

The folder (docs/shift.md):

    config.json            the resolved config, written first
    <corruption>.npy       uint8 [5*N, H, W, C]: severity 1's N images, then 2's, ... 5's, in
                           real/test's order; C = 1 when every test image is grey, else 3
    labels.npy             int64 [5*N]: real/test's labels, once per severity (as CIFAR-C)
    preview.png            corruption x severity, on the first test image
    .done/<file>.json      {name, sha256, bytes, upstream} of each file, written after it is
                           in place (upstream: the real/test digest it was made from)
    manifest.json          written last: kind `corruptions`, upstream {real/test: digest},
                           info {files: {name: {sha256, bytes}}, corruptions: ladders, ...}

Every file is written to a temporary name and renamed into place; a rerun skips the files whose
record matches and rewrites the others, so a killed build resumes to the same bytes. A complete
folder (manifest present) is never written again: the same config and real/test skip, another
config or another real/test is refused in one line. The draws of a (corruption, severity) come
from one numpy generator seeded by (seed, "shift", corruption, severity).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from core.io import atomic_write_json, read_json, sha256_file, tmp_path_for, writing
from core.logs import log, progress
from core.plots import image_grid
from core.seeding import derive_seed
from core.version import code_version
from models.corruptions import SEVERITIES, corrupt, describe
from shards.manifest import (
    Manifest,
    ShardError,
    is_complete,
    manifest_digest,
    read_manifest,
    write_manifest,
)
from shards.reader import load_split
from shards.writer import DONE_DIR, write_config
from stages.configs.shift import Config

SHIFT = "shift"
FOLDER = "test-c"  # runs/<classes>/shift/test-c/
KIND = "corruptions"
LABELS, PREVIEW = "labels.npy", "preview.png"


def shift_dir(root: Path) -> Path:
    return Path(root) / SHIFT / FOLDER


# ---------------------------------------------------------------- files with records


def _record(dest: Path, name: str, upstream: str) -> dict[str, Any] | None:
    """The completion record of `name` if the file is in place with the recorded size and was
    made from this real/test (`upstream`: its manifest digest); else None (redo the file)."""
    rec_path = dest / DONE_DIR / f"{name}.json"
    if not rec_path.is_file():
        return None
    rec = read_json(rec_path)
    path = dest / name
    if not path.is_file() or path.stat().st_size != rec.get("bytes"):
        return None
    return rec if rec.get("upstream") == upstream else None


def _write_npy(dest: Path, name: str, array: np.ndarray, upstream: str) -> dict[str, Any]:
    """`array` as dest/name (.npy, no pickles) via a temporary file and a rename, then its
    completion record (with the real/test digest it was made from)."""
    path = dest / name
    tmp = tmp_path_for(path)
    with writing(path, tmp):
        with open(tmp, "wb") as f:
            np.lib.format.write_array(f, np.ascontiguousarray(array), allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    rec = {"name": name, "sha256": sha256_file(path), "bytes": path.stat().st_size}
    rec["upstream"] = upstream
    atomic_write_json(dest / DONE_DIR / f"{name}.json", rec)
    return rec


def _already_complete(cfg: Config, dest: Path, upstream: dict[str, str]) -> bool:
    """A complete folder of this config: made from this real/test (skip), or from another one
    (refused in one line: a complete folder is never rewritten)."""
    if not is_complete(dest):
        return False
    write_config(dest, cfg.recorded())  # compares only: refuses another config
    if read_manifest(dest).upstream != upstream:
        raise ShardError(
            f"{dest} is complete but was made from another real/test (its manifest's digest "
            f"differs): remove the folder to rebuild it from today's real/test"
        )
    log.info("shift: %s is complete already", dest)
    return True


# ---------------------------------------------------------------- the stage


def grey_or_colour(images: np.ndarray) -> np.ndarray:
    """uint8 [N, H, W, 3] -> [N, H, W, 1] when every image is grey (R = G = B), else as is."""
    if (images[..., 0] == images[..., 1]).all() and (images[..., 0] == images[..., 2]).all():
        return images[..., :1]
    return images


def corrupted_stack(images: np.ndarray, name: str, seed: int) -> np.ndarray:
    """Severities 1..5 of one corruption stacked: uint8 [5*N, H, W, C]."""
    return np.concatenate(
        [
            corrupt(images, name, s, np.random.default_rng(derive_seed(seed, SHIFT, name, s)))
            for s in SEVERITIES
        ]
    )


def write_preview(dest: Path, clean: np.ndarray, names: tuple[str, ...]) -> None:
    """preview.png: rows = corruptions, columns = clean then severities 1..5 (first test image)."""
    rows = []
    for name in names:
        stack = np.load(dest / f"{name}.npy", mmap_mode="r", allow_pickle=False)
        n = stack.shape[0] // len(SEVERITIES)
        rows.append([clean[0], *(stack[k * n] for k in range(len(SEVERITIES)))])
    tiles = np.asarray(rows)
    if tiles.shape[-1] == 1:
        tiles = np.repeat(tiles, 3, axis=-1)
    image_grid(
        tiles,
        dest / PREVIEW,
        row_labels=names,
        col_labels=["clean", *map(str, SEVERITIES)],
        scale=max(1, 84 // tiles.shape[2]),
    )


def run(cfg: Config) -> Path:
    # 1. Inputs: real/test must be a complete prepared split (else one line naming prepare).
    test = cfg.root / "real" / "test"
    upstream = {"real/test": manifest_digest(test)}
    dest = shift_dir(cfg.root)
    if _already_complete(cfg, dest, upstream):
        return dest
    write_config(dest, cfg.recorded())
    for leftover in dest.glob(".*.tmp"):  # a file a killed build was writing
        leftover.unlink()
    split = load_split(test)
    keep = slice(0, cfg.limit or None)
    images = grey_or_colour(split.images[keep].numpy())
    n, size, channels = len(images), images.shape[1], images.shape[-1]
    log.info(
        "shift: %d corruptions x %d severities of %d test images (%dx%d, %s) -> %s",
        *(len(cfg.corruptions), len(SEVERITIES), n, size, size, ("grey", "colour")[channels > 1]),
        dest,
    )
    # 2. labels.npy, then one <corruption>.npy each, skipping files already complete (resume).
    digest = upstream["real/test"]
    labels = np.tile(split.labels[keep].numpy().astype(np.int64), len(SEVERITIES))
    records = {LABELS: _record(dest, LABELS, digest) or _write_npy(dest, LABELS, labels, digest)}
    with progress(cfg.corruptions, total=len(cfg.corruptions), desc="shift", unit="set") as bar:
        for name in bar:
            file = f"{name}.npy"
            records[file] = _record(dest, file, digest) or _write_npy(
                dest, file, corrupted_stack(images, name, cfg.seed), digest
            )
    # 3. The preview, then the manifest last: the folder is complete only now.
    write_preview(dest, images, cfg.corruptions)
    files = {
        name: {"sha256": rec["sha256"], "bytes": rec["bytes"]} for name, rec in records.items()
    }
    files[PREVIEW] = {
        "sha256": sha256_file(dest / PREVIEW),
        "bytes": (dest / PREVIEW).stat().st_size,
    }
    ladders = describe()
    info = {
        "split": "real/test",
        "num_images": n,
        "image_size": size,
        "channels": channels,
        "severities": list(SEVERITIES),
        "corruptions": {name: ladders[name] for name in cfg.corruptions},
        "files": dict(sorted(files.items())),
    }
    manifest = Manifest(
        KIND, split.class_names, (), upstream=upstream, code_version=code_version(), info=info
    )
    write_manifest(dest, manifest)
    log.info("shift: %s complete (%d corruptions, preview %s)", dest, len(cfg.corruptions), PREVIEW)
    return dest
