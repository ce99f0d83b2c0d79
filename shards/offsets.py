"""Byte offsets of a shard's members: read one sample without reading the rest of the shard.

Random access (the streaming data path, `shards.stream`) needs where each member's payload
starts. The writer records it per shard in `.index/PREFIX-000000.json`, written after the tar
is renamed into place and before the shard's completion record (docs/architecture.md):

    {"bytes": 812032, "members": [["train_0000000.cls", 512, 1], ["train_0000000.png", 1536, 701],
     ...], "name": "train-000000.tar", "sha256": "<the tar's sha256>", "version": 1}

`members` = [member name, byte offset of its payload, payload size], in file order. The tar's
own bytes are untouched, so existing shards keep their bytes and manifests their digests.

The index is a cache, never a source of truth: it is used only when its name, size and sha256
are the manifest record's, else (a folder without `.index/`, one pulled from the Hub,
or an index for other bytes) the offsets come from scanning the tar headers, one 512-byte read
per member, and nothing is written (a complete folder is never modified). And every payload
read (`read_member`) reads the member's header block with it and checks its name, size and
checksum: a damaged index fails loudly instead of handing back another sample's bytes.
"""

from __future__ import annotations

import logging
import os
import tarfile
from pathlib import Path

from core.io import atomic_write_bytes, canonical_json, read_json
from shards.manifest import ShardError, ShardRecord, rerun_hint
from shards.reader import BLOCK, NotPlainUstar, padded, ustar_header

INDEX_DIR = ".index"
INDEX_VERSION = 1
log = logging.getLogger("semix")

Member = tuple[str, int, int]  # (member name, payload offset, payload size)


def index_path(folder: Path, shard: str) -> Path:
    """`.index/train-000000.json` for shard `train-000000.tar`."""
    return Path(folder) / INDEX_DIR / f"{Path(shard).stem}.json"


def scan_members(path: Path) -> list[Member]:
    """Members of a tar from its headers alone (reads 512 bytes per member, not the payloads).

    Plain ustar (every semix shard) is walked with `pread`; anything else goes through tarfile.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            fd, end = f.fileno(), os.fstat(f.fileno()).st_size
            members: list[Member] = []
            off = 0
            while off + BLOCK <= end:
                parsed = ustar_header(os.pread(fd, BLOCK, off), path, off)
                if parsed is None:
                    return members  # end-of-archive marker
                name, size = parsed
                if off + BLOCK + size > end:
                    raise ShardError(f"{path} is truncated inside {name!r}")
                members.append((name, off + BLOCK, size))
                off += BLOCK + padded(size)
    except NotPlainUstar:
        return _tarfile_scan(path)
    except OSError as e:
        raise ShardError(f"cannot read shard {path}: {e.strerror or e}") from e
    raise ShardError(f"{path} is truncated (no end-of-archive marker)")


def _tarfile_scan(path: Path) -> list[Member]:
    try:
        with tarfile.open(path, mode="r:") as tar:
            return [(m.name, m.offset_data, m.size) for m in tar if m.isfile()]
    except (tarfile.TarError, EOFError) as e:
        raise ShardError(f"{path} is damaged ({e})") from e


def write_index(folder: Path, rec: ShardRecord, members: list[Member]) -> Path:
    """Record `members` of the shard `rec` describes (the writer calls this before the shard's
    completion record, so a complete shard written by this code always has its index)."""
    path = index_path(folder, rec.name)
    doc = {
        "version": INDEX_VERSION,
        "name": rec.name,
        "bytes": rec.bytes,
        "sha256": rec.sha256,
        "members": [list(m) for m in members],
    }
    atomic_write_bytes(path, canonical_json(doc, indent=None))
    return path


def read_index(folder: Path, rec: ShardRecord) -> list[Member] | None:
    """The recorded members of shard `rec`, or None when there is no index for exactly these
    bytes (absent, another version, another sha256 or size, malformed)."""
    path = index_path(folder, rec.name)
    if not path.is_file():
        return None
    try:
        doc = read_json(path)
        same = (doc["version"], doc["name"], doc["bytes"], doc["sha256"]) == (
            INDEX_VERSION,
            rec.name,
            rec.bytes,
            rec.sha256,
        )
        members = [(str(n), int(o), int(s)) for n, o, s in doc["members"]] if same else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring %s (%s): scanning the tar headers instead", path, e)
        return None
    if members is None or any(o < BLOCK or o + s > rec.bytes for _, o, s in members):
        log.warning("ignoring %s: not an index of these shard bytes; scanning the tar", path)
        return None
    return members


def shard_members(folder: Path, rec: ShardRecord) -> list[Member]:
    """Members of one shard of a folder: the recorded index if it fits, else a header scan."""
    members = read_index(folder, rec)
    return members if members is not None else scan_members(Path(folder) / rec.name)


def read_member(
    fd: int, path: Path, name: str, offset: int, size: int, kind: str = "", max_bytes: int = -1
) -> bytes:
    """Payload of member `name` at `offset` (its first `max_bytes` bytes if max_bytes >= 0), read
    together with its header block, which must name the same member, with the same size and
    a valid checksum (one pread)."""
    want = size if max_bytes < 0 else min(size, max_bytes)
    data = os.pread(fd, BLOCK + want, offset - BLOCK)
    header = data[:BLOCK]
    try:
        try:
            parsed = ustar_header(header, path, offset - BLOCK)
        except NotPlainUstar:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
            parsed = info.name, info.size
    except (ShardError, tarfile.TarError):
        parsed = None
    if len(data) != BLOCK + want or parsed != (name, size):
        raise ShardError(
            f"{path}: member {name!r} is not at byte {offset} (the shard changed since it was "
            f"opened, or its offset index is wrong); {rerun_hint(kind, Path(path).parent)}"
        )
    return data[BLOCK:]
