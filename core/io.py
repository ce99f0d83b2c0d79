"""Small file primitives shared by every writer: atomic writes and checksums.

A reader must never see a half-written file under its final name, so every file is
written to a temporary sibling and moved into place with `os.replace` (atomic on POSIX).
Temporary names are deterministic (no pid, no time) so that a rerun after a crash
overwrites the leftovers instead of accumulating them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def tmp_path_for(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def canonical_json(obj: Any, indent: int | None = 2) -> bytes:
    """JSON with sorted keys and a trailing newline: equal objects give equal bytes."""
    separators = (",", ": ") if indent else (",", ":")
    text = json.dumps(obj, sort_keys=True, indent=indent, separators=separators, ensure_ascii=False)
    return (text + "\n").encode("utf-8")


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, canonical_json(obj))


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
