"""Deterministic WebDataset shard writer with per-shard completion records.

Layout of a shard folder (docs/architecture.md, Shard folders)::

    NAME-000000.tar  NAME-000001.tar  ...   WebDataset tar shards
    .index/NAME-000000.json ...              member byte offsets per shard (shards.offsets)
    .done/NAME-000000.json ...               completion record per shard (written after the shard)
    manifest.json                            written last by `finish`

Resume rule: a shard counts as done only when its completion record exists and the tar
still has the recorded size; anything else is rewritten from scratch. Tar members are
written in sorted order with fixed mtime/owner/mode, and samples are encoded
canonically (PNG settings fixed, JSON with sorted keys), so the same samples always give
the same bytes, and an interrupted-then-resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import webdataset as wds
from PIL import Image

from core.config import set_value
from core.io import (
    atomic_write_json,
    canonical_json,
    read_json,
    sha256_file,
    tmp_path_for,
    writing,
)
from core.logs import log
from shards.datapath import DATA_FIELDS
from shards.manifest import (
    Manifest,
    ShardError,
    ShardRecord,
    check_size,
    is_complete,
    read_manifest,
    rerun_hint,
    write_manifest,
)
from shards.offsets import scan_members, write_index

DONE_DIR = ".done"
# Sample fields we write; the reader refuses anything else (in particular pickles).
IMAGE_EXT = "png"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def shard_name(prefix: str, index: int) -> str:
    return f"{prefix}-{index:06d}.tar"


def encode_png(image: Any) -> bytes:
    """uint8 HxWx3 (numpy, torch or PIL) -> PNG bytes, with fixed encoder settings."""
    if isinstance(image, Image.Image):
        pil = image.convert("RGB")
    else:
        arr = np.asarray(image.cpu() if hasattr(image, "cpu") else image)
        if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
            raise ValueError(f"images must be uint8 HxWx3, got {arr.dtype} {arr.shape}")
        pil = Image.fromarray(arr, mode="RGB")
    buf = io.BytesIO()
    pil.save(buf, format="PNG", compress_level=6, optimize=False)
    return buf.getvalue()


def encode_sample(sample: Mapping[str, Any]) -> dict[str, Any]:
    """Our sample dict -> tar members. Fields: __key__, png (image array, or PNG bytes passed
    through unchanged), cls (int), json (dict)."""
    key = sample["__key__"]
    if not key or "." in key or "/" in key:
        raise ValueError(f"sample key {key!r} must be non-empty and contain no dots or slashes")
    out: dict[str, Any] = {"__key__": key}
    for field, value in sample.items():
        if field == "__key__":
            continue
        if field == IMAGE_EXT and isinstance(value, (bytes, bytearray)):
            if not bytes(value[:8]) == PNG_SIGNATURE:
                raise ValueError(f"sample {key!r}: png bytes are not a PNG file")
            out[field] = bytes(value)  # already encoded (e.g. copied from another shard): keep it
        elif field == IMAGE_EXT:
            out[field] = encode_png(value)
        elif field == "cls":
            out[field] = str(int(value)).encode("ascii")
        elif field == "json":
            out[field] = canonical_json(value, indent=None)
        else:
            raise ValueError(f"unsupported sample field {field!r} (allowed: png, cls, json)")
    return out


def write_tar(path: Path, samples: Iterable[Mapping[str, Any]]) -> int:
    """Write samples to `path` atomically; returns the number of samples."""
    tmp = tmp_path_for(path)
    count = 0
    with writing(path, tmp):  # a full disk or read-only media names the shard
        with open(tmp, "wb") as f:
            # mtime fixed and owner blank: tar headers carry no trace of when or who wrote them.
            with wds.TarWriter(f, encoder=False, mtime=0, user="", group="") as tar:
                for sample in samples:
                    tar.write(encode_sample(sample))
                    count += 1
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return count


class ShardFolder:
    """Write side of one shard folder (one split of real/, or series/, or mixed/)."""

    def __init__(self, folder: Path, prefix: str):
        self.folder = Path(folder)
        self.prefix = prefix
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, index: int) -> Path:
        return self.folder / shard_name(self.prefix, index)

    def _record_path(self, index: int) -> Path:
        return self.folder / DONE_DIR / f"{self.prefix}-{index:06d}.json"

    def done(self, index: int) -> ShardRecord | None:
        """The completion record of shard `index` if the shard is complete, else None."""
        rec_path = self._record_path(index)
        if not rec_path.is_file():
            return None
        rec = ShardRecord(**read_json(rec_path))
        path = self.path(index)
        if not path.is_file() or path.stat().st_size != rec.bytes:
            return None
        return rec

    def write(self, index: int, samples: Iterable[Mapping[str, Any]]) -> ShardRecord:
        """Write shard `index`, then its offset index (random access, `shards.offsets`), then
        (only then) its completion record."""
        path = self.path(index)
        count = write_tar(path, samples)
        rec = ShardRecord(
            name=path.name, count=count, sha256=sha256_file(path), bytes=path.stat().st_size
        )
        write_index(self.folder, rec, scan_members(path))
        atomic_write_json(self._record_path(index), rec.__dict__)
        return rec

    def finish(
        self,
        num_shards: int,
        *,
        kind: str,
        class_names: Iterable[str],
        upstream: Mapping[str, str] | None = None,
        code_version: str = "",
        info: Mapping[str, Any] | None = None,
    ) -> Manifest:
        """Write manifest.json from the completion records of shards 0..num_shards-1."""
        records = []
        for i in range(num_shards):
            rec = self.done(i)
            if rec is None:
                raise ShardError(
                    f"cannot finish {self.folder}: shard {shard_name(self.prefix, i)} is not complete"
                )
            records.append(rec)
        manifest = Manifest(
            kind=kind,
            class_names=tuple(class_names),
            shards=tuple(records),
            upstream=dict(upstream or {}),
            code_version=code_version,
            info=dict(info or {}),
        )
        write_manifest(self.folder, manifest)
        return manifest


# Config fields that say where an output lives or how it is read, not what it holds: left out
# of the identity check, so that moving or renaming the runs root, or a relative vs absolute
# out=, keeps an output resumable (docs/architecture.md, Shard folders), and so is turning shard hashing off or
# switching between the in-memory and the streaming data path (same bytes either way), or
# experiment tracking on or off (`tracker`, core/tracking.py: its files live in a subfolder no
# manifest lists). A config says this at the field (core.config.not_recorded), and its
# `recorded()` leaves them out; this list also keeps them out of a dict that still holds them.
NOT_IDENTITY = ("out", "name", "verify_sha256", "tracker", *DATA_FIELDS)


# Config fields that name a file or folder of the user's (prepare's data_dir=): recorded and
# compared resolved, so `data_dir=data/x` and its absolute spelling are one source, never "a
# different config". A relative value a config.json already holds is read from the working
# folder, as the run that wrote it read it (the best guess of where that was).
PATH_FIELDS = ("data_dir",)


def _resolved(key: str, value: Any) -> Any:
    if key in PATH_FIELDS and isinstance(value, str) and value:
        return str(Path(value).expanduser().resolve())
    return value


def _identity(config: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _resolved(k, v) for k, v in config.items() if k not in NOT_IDENTITY}


# what to do about a folder that holds another config (write_config's `fix`)
OTHER_ROOT = "remove the folder or write to another OUT/name"


def _named(config: Mapping[str, Any]) -> Callable[[str], str]:
    """How the command line names a config.json key: its tree path where the config knows it
    (core.config.Recorded: `lr` -> `optim.lr`), else the key as recorded."""
    return getattr(config, "named", str)


def _given(config: Mapping[str, Any], key: str, named: Callable[[str], str] = str) -> str:
    """`key=value` as --set spells it (`named(key)`), shortened; `key unset` when the config
    lacks it."""
    if key not in config:
        return f"{named(key)} unset"
    value = set_value(tuple(config[key]) if isinstance(config[key], list) else config[key])
    return f"{named(key)}={value if len(value) <= 40 else value[:39] + '…'}"


def changed_fields(folder: Path, config: Mapping[str, Any]) -> list[str]:
    """The fields in which `folder`'s config.json differs from `config` (compared without
    NOT_IDENTITY); [] when they agree or the folder holds no config.json. Reads only."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return []
    old, new = _identity(read_json(path)), _identity(config)
    if canonical_json(old) == canonical_json(new):
        return []
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def claimed(folder: Path, parts: Iterable[str] = ()) -> bool:
    """Whether `folder` defends its config: only a complete folder does (its manifest.json, or
    with `parts` the manifest of every part: prepare's real/ is complete when each split is).
    The one completion rule: no manifest, no claim; a folder that never completed (a run that
    diverged, a prepare stopped by a bad value) holds nobody's output, so a rerun with other
    values replaces it (write_config) instead of being refused."""
    folder = Path(folder)
    return all(is_complete(folder / p) for p in parts) if parts else is_complete(folder)


def replaces(folder: Path, config: Mapping[str, Any], parts: Iterable[str] = ()) -> bool:
    """Whether write_config will replace `folder`: it holds another config and never completed
    (so its checkpoints and partial shards are not this run's to resume). Reads only."""
    return bool(changed_fields(folder, config)) and not claimed(folder, tuple(parts))


def check_config(
    folder: Path, config: Mapping[str, Any], fix: str = OTHER_ROOT, parts: Iterable[str] = ()
) -> bool:
    """Whether `folder` holds a config.json that is `config` (compared without NOT_IDENTITY).
    A complete folder (`claimed`) with another config is refused in one line naming every field
    that differs, with both values, and then `fix` (what to do instead); an incomplete one is
    not ours (False): write_config replaces it. Reads only."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    changed = changed_fields(folder, config)
    if not changed:
        return True
    if not claimed(folder, tuple(parts)):
        return False
    old, new, named = read_json(path), dict(config), _named(config)
    raise ShardError(
        f"{folder} holds a run with a different config (differs in: "
        f"{', '.join(map(named, changed))}): it has "
        f"{' '.join(_given(old, k, named) for k in changed)}, this one asks "
        f"{' '.join(_given(new, k, named) for k in changed)}; {fix}"
    )


def write_config(
    folder: Path, config: Mapping[str, Any], fix: str = OTHER_ROOT, parts: Iterable[str] = ()
) -> None:
    """Write the stage's resolved config first thing; refuse to mix two configs in one folder.

    Resuming is only safe when the rerun asks for exactly the same thing; otherwise the
    folder would end up holding shards of two different runs. An existing config.json is only
    compared (check_config), never rewritten: a complete folder on read-only media stays
    untouched. A folder that never completed under another config is nobody's output, so it is
    no identity to defend: it is replaced, with a line saying so (`claimed`; `parts`: the
    subfolders whose manifests complete it), and a failed run never blocks the rerun that fixes
    its values. Where the folder lives (NOT_IDENTITY) is neither compared nor recorded.
    """
    folder = Path(folder)
    if check_config(folder, config, fix, parts):
        return
    changed = changed_fields(folder, config)
    if changed:  # not claimed (check_config refuses a complete one): nobody's output
        old, named = read_json(folder / "config.json"), _named(config)
        why = (
            f"it never completed (no manifest) and was made with "
            f"{' '.join(_given(old, k, named) for k in changed)}; this run "
            f"({' '.join(_given(dict(config), k, named) for k in changed)}) starts it over"
        )
        if not replace_incomplete(folder, why):
            return  # another process replaced it at the same time and writes the config
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / "config.json", _identity(config))


def replace_incomplete(folder: Path, why: str) -> bool:
    """Remove `folder`, which holds no complete output (`claimed` is False), logging one line
    with `why`; False when another process removed it first. The folder is moved aside first
    (one atomic rename: of processes doing this at once only one wins, and a kill leaves the
    aside copy, removed by the next replacement, never a half-removed folder)."""
    folder = Path(folder)
    aside = tmp_path_for(folder)
    shutil.rmtree(aside, ignore_errors=True)  # what a killed replacement left
    try:
        os.replace(folder, aside)
    except FileNotFoundError:
        return False
    shutil.rmtree(aside, ignore_errors=True)
    log.info("%s: replaced (%s)", folder, why)
    return True


def completed(
    folder: Path,
    config: Mapping[str, Any] | None = None,
    upstream: Mapping[str, str] | None = None,
) -> bool:
    """True if `folder` is complete (manifest.json) for this config and these upstream manifest
    digests (each checked when given): the stage has nothing to do and must only read, so that
    a rerun works on read-only media.

    A different config is refused (write_config); a complete folder built from other upstream
    folders, or without a config.json of ours (e.g. pulled), is not complete for this run.
    """
    folder = Path(folder)
    if not is_complete(folder):
        return False
    if config is not None:
        if not (folder / "config.json").is_file():
            return False
        write_config(folder, config)  # compares only: the file exists
    manifest = read_manifest(folder)
    check_sizes(folder, manifest)
    return upstream is None or manifest.upstream == dict(upstream)


def check_sizes(folder: Path, manifest: Manifest) -> None:
    """Every shard of a complete folder is there with its recorded size (a stat each, no
    reading): a rerun never calls a truncated or missing shard complete. The error names the
    shard and the command that rewrites the folder."""
    for rec in manifest.shards:
        path = Path(folder) / rec.name
        if not path.is_file():
            raise ShardError(
                f"{path} is listed in the manifest but missing; {rerun_hint(manifest.kind, folder)}"
            )
        check_size(path, path.stat().st_size, rec, manifest.kind)
