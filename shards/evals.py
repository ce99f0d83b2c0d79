"""Evaluation folders on disk: `runs/<classes>/eval/<stage>/<run>/`, complete when its manifest is.

    eval/train/<run>/        a train run's evaluation
    eval/finetune/<run>/     a fine-tuned run's (same name in train/ and finetune/: two folders)
    eval/ensemble/<name>/    a deep ensemble of several runs
    eval/report.md           every complete evaluation side by side (stages/evaluate/report.py)

Each folder holds `metrics.json` ({"evaluation": {...}}, plus {"ensemble": {...}} for an
ensemble), `predictions.npz` (test logits, labels, temperature, class names; plain arrays, load
with allow_pickle=False), `reliability.png`, and `manifest.json` (kind `eval`) written last. The
manifest pins what the evaluation was made from (`upstream`: the run's digest and the digests of
real/test and real/val, plus the OOD set and corruptions when used), the settings that change
its numbers (`info.settings`) and the sha256 of every file (`info.files`).

Why a folder of its own: a finished run is never written into again (one completion rule for
every output), and an evaluation is a function of its upstream: when a run is retrained its
digest changes and the old evaluation is stale, which a reader sees by comparing digests,
never time stamps. A folder is built under a hidden sibling (`.<name>.tmp`) and renamed into
place, so no reader ever sees a half-written evaluation under the real name.

Also here: the two extra test sets evaluate may read besides real/ (an OOD split, CIFAR-C arrays).
"""

from __future__ import annotations

import io
import os
import shutil
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from core.io import canonical_json, read_json, sha256_bytes, sha256_file
from shards.manifest import (
    MANIFEST,
    Manifest,
    ShardError,
    is_complete,
    read_manifest,
    write_manifest,
)

EVAL = "eval"
KIND = "eval"
METRICS, PREDICTIONS, RELIABILITY = "metrics.json", "predictions.npz", "reliability.png"
REPORT = "report.md"
ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip can hold: no clock in the bytes


class EvalError(ShardError):
    """An evaluation folder is incomplete or damaged: named for what failed, a ShardError for
    every `except ShardError` (a damaged evaluation is redone or left out of the report)."""


# The layout of predictions.npz, in every evaluation's settings: one written with another
# layout is stale and redone. 2: the OOD sets' logits too (ood_logits_key).
PREDICTIONS_FORMAT = 2


def ood_logits_key(ood_set: str) -> str:
    """predictions.npz's array of the logits on the OOD set `ood_set`, [N_ood, C]."""
    return f"ood_logits_{ood_set}"


def eval_dir(root: Path, stage: str, name: str) -> Path:
    """Where the evaluation of `stage/name` lives (stage: train | finetune | ensemble)."""
    return Path(root) / EVAL / stage / name


def report_path(root: Path) -> Path:
    return Path(root) / EVAL / REPORT


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """An .npz archive that `np.load` reads, with fixed zip time stamps: np.savez stamps every
    member with the current time, so the same arrays would give other bytes each run."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as archive:
        for key, value in arrays.items():
            info = zipfile.ZipInfo(f"{key}.npy", date_time=ZIP_TIME)
            with archive.open(info, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(value), allow_pickle=False)
    return buf.getvalue()


# ---------------------------------------------------------------- writing


@contextmanager
def building(dest: Path) -> Iterator[Path]:
    """Yield an empty hidden sibling of `dest` to write into; on a clean exit it replaces `dest`.

    The caller writes its files and, last, the manifest (`finish`). An exception removes the
    sibling and leaves `dest` as it was (a previous complete evaluation stays readable); a kill
    leaves only the hidden sibling, which the next attempt clears.
    """
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not is_complete(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        raise EvalError(f"{dest}: built without a {MANIFEST}; nothing was installed")
    old = dest.with_name(f".{dest.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)  # the stale evaluation steps aside ...
    os.replace(tmp, dest)  # ... and the new one takes its name in one rename
    shutil.rmtree(old, ignore_errors=True)


def finish(
    folder: Path,
    *,
    class_names: tuple[str, ...],
    upstream: Mapping[str, str],
    settings: Mapping[str, Any],
    code_version: str,
    info: Mapping[str, Any] | None = None,
) -> Manifest:
    """Write the manifest, last: the digests of every file already in `folder`."""
    files = {
        p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        for p in sorted(Path(folder).iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    manifest = Manifest(
        KIND,
        tuple(class_names),
        (),
        upstream=dict(upstream),
        code_version=code_version,
        info={**(info or {}), "settings": dict(settings), "files": files},
    )
    write_manifest(folder, manifest)
    return manifest


# ---------------------------------------------------------------- reading


def read_eval(folder: Path) -> Manifest:
    """The manifest of a complete evaluation folder whose files match it; else an EvalError."""
    manifest = read_manifest(folder)
    if manifest.kind != KIND:
        raise EvalError(f"{folder} holds a {manifest.kind!r} folder, not an evaluation")
    files = manifest.info.get("files", {})
    for name in (METRICS, PREDICTIONS):
        if name not in files:
            raise EvalError(f"{folder}/{MANIFEST} lists no {name}; rerun evaluate")
    for name, rec in files.items():
        path = Path(folder) / name
        if not path.is_file() or path.stat().st_size != rec["bytes"]:
            raise EvalError(f"{path}: missing or of another size than {MANIFEST} says")
        if sha256_file(path) != rec["sha256"]:
            raise EvalError(f"{path}: sha256 mismatch with {MANIFEST}; rerun evaluate")
    return manifest


def is_current(folder: Path, upstream: Mapping[str, str], settings: Mapping[str, Any]) -> bool:
    """True when `folder` is a complete, undamaged evaluation of exactly this upstream and these
    settings: a rerun may skip it. Missing, incomplete, stale or damaged: False (redo it)."""
    if not is_complete(folder):
        return False
    try:
        manifest = read_eval(folder)
    except ShardError:
        return False
    return manifest.upstream == dict(upstream) and manifest.info.get("settings") == dict(settings)


def read_metrics(folder: Path) -> dict[str, Any] | None:
    """metrics.json of a complete evaluation folder (checked against its manifest), else None."""
    if not is_complete(folder):
        return None
    read_eval(folder)
    return read_json(Path(folder) / METRICS)


def evaluated(root: Path, stages: tuple[str, ...]) -> Iterator[tuple[str, str, Path]]:
    """(stage, name, folder) of every complete evaluation under root/eval/<stage>/, sorted by
    name; hidden work folders (`.<name>.tmp`, `.<name>.old`) are never listed."""
    for stage in stages:
        base = Path(root) / EVAL / stage
        if not base.is_dir():
            continue
        for folder in sorted(base.iterdir()):
            if folder.is_dir() and not folder.name.startswith(".") and is_complete(folder):
                yield stage, folder.name, folder


# ---------------------------------------------------------------- extra test sets


def ood_folder(path: str) -> Path:
    """A split folder, a real/ root or a runs/<name>/ root -> the split folder to score."""
    p = Path(path)
    for candidate in (p, p / "test", p / "real" / "test"):
        if is_complete(candidate):
            return candidate
    raise ShardError(
        f"ood={path}: no prepared split there (looked for {MANIFEST} in ., test/, real/test/); "
        "give a prepared split, a real/ root or a runs/<name>/ root (the ood stage writes "
        "runs/<classes>/ood/<set>), or leave ood= empty"
    )


def ood_folders(paths: tuple[str, ...]) -> dict[str, Path]:
    """{set name: split folder} for evaluate's `ood=` paths: the name is the folder's own
    (runs/<classes>/ood/<set>), or the root's for a real/ root or runs/<name>/ root."""
    out: dict[str, Path] = {}
    for path in paths:
        folder = ood_folder(path)
        name = folder.parent.parent.name if folder.parent.name == "real" else folder.name
        if name in out:
            raise ShardError(f"ood={','.join(paths)}: two OOD sets are named {name!r}")
        out[name] = folder
    return out


def corruption_sets(path: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """CIFAR-C layout: {name: uint8 [5·N, H, W, 3] (memory-mapped)}, labels [N] or [5·N]. Grey
    sets (MNIST-C's [5·N, H, W, 1], the shift stage's for grey datasets) come back as a
    read-only 3-channel view of the same memory map (R = G = B), as prepared grey splits are."""
    folder = Path(path)
    if not (folder / "labels.npy").is_file():
        raise ShardError(f"corruptions={path}: no labels.npy (expected CIFAR-C layout)")
    labels = np.load(folder / "labels.npy", allow_pickle=False)
    sets = {}
    for f in sorted(folder.glob("*.npy")):
        if f.stem == "labels":
            continue
        arr = np.load(f, mmap_mode="r", allow_pickle=False)
        if (
            arr.ndim != 4
            or arr.shape[-1] not in (1, 3)
            or arr.dtype != np.uint8
            or arr.shape[0] % 5
        ):
            raise ShardError(
                f"{f}: expected uint8 [5*N, H, W, 3] (or grey [5*N, H, W, 1]), got "
                f"{arr.dtype} {arr.shape}"
            )
        if arr.shape[-1] == 1:
            arr = np.broadcast_to(arr, (*arr.shape[:3], 3))
        if len(labels) not in (arr.shape[0], arr.shape[0] // 5):
            raise ShardError(f"{f}: {arr.shape[0]} images but {len(labels)} labels")
        sets[f.stem] = arr
    if not sets:
        raise ShardError(f"corruptions={path}: no <corruption>.npy files")
    return sets, labels


def corruptions_digest(path: str) -> str:
    """sha256 over the CIFAR-C folder's arrays (name -> sha256 of each .npy)."""
    files = sorted(Path(path).glob("*.npy"))
    return sha256_bytes(canonical_json({f.name: sha256_file(f) for f in files}))
