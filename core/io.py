"""Small file primitives shared by every writer: atomic writes and checksums.

A reader must never see a half-written file under its final name, so every file is
written to a temporary sibling and moved into place with `os.replace` (atomic on POSIX).
Temporary names are deterministic (no pid, no time) so that a rerun after a crash
overwrites the leftovers instead of accumulating them.

A write that fails (a full disk, an exhausted quota, read-only media) raises an OSError that
names the file it was writing (`writing`): Python's `f.write`/`flush`/`fsync` raise theirs
without a file name, safetensors reports an OSError as text, and torch.save's zip writer as a
RuntimeError without an errno. The CLI prints it as one line (pipeline/cli.py).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20
# what torch.save's zip writer (a path target) raises when a write fails: it keeps no errno
_TORCH_WRITE_FAILED = ("PytorchStreamWriter failed", "unexpected pos", "cannot be opened")
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # Rust's io::Error, as safetensors words it


def _inside(name: Any, folder: Path | None) -> bool:
    """`name` (an OSError's filename) is `folder` or lies under it."""
    if folder is None or not isinstance(name, (str, bytes, os.PathLike)):
        return False
    path, folder = Path(os.path.abspath(os.fsdecode(name))), Path(os.path.abspath(folder))
    return path == folder or folder in path.parents


def storage_errno(path: Path) -> int:
    """Why writing at `path` fails, asked of the file system, for writers that keep no errno:
    EROFS on read-only media, ENOSPC with less than 1 MiB free, else what a 1 MiB probe write
    next to it raises (EDQUOT: a quota), else EIO."""
    folder = Path(os.path.abspath(path))
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    try:
        st = os.statvfs(folder)
    except OSError as e:
        return e.errno or errno.EIO
    if st.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if st.f_bavail * st.f_frsize < _CHUNK:
        return errno.ENOSPC
    probe = folder / ".semix-write-probe"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(_CHUNK))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return e.errno or errno.EIO
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return errno.EIO


def native_write_errno(error: BaseException, path: Path) -> int | None:
    """The errno behind a write failure that a library reports without one (safetensors'
    SafetensorError text, torch.save's RuntimeError); None if `error` is no such failure."""
    text = str(error)
    if type(error).__name__ == "SafetensorError":
        found = _OS_ERROR.search(text)
        return int(found.group(1)) if found else None
    if isinstance(error, RuntimeError) and any(s in text for s in _TORCH_WRITE_FAILED):
        return storage_errno(path)
    return None


@contextlib.contextmanager
def writing(path: Path, tmp: Path | None = None) -> Iterator[None]:
    """Every I/O error raised inside names `path`: one without a file name (f.write, flush,
    fsync), one under `tmp` (the temporary file or folder `path` is written through), and the
    write failures safetensors and torch.save report without an errno. Other errors pass."""
    try:
        yield
    except OSError as e:
        if e.errno is None or (e.filename is not None and not _inside(e.filename, tmp)):
            raise
        raise OSError(e.errno, e.strerror or os.strerror(e.errno), str(path)) from e
    except Exception as e:  # a native writer's failure, or anything else (re-raised as it is)
        code = native_write_errno(e, Path(path))
        if code is None:
            raise
        raise OSError(code, os.strerror(code), str(path)) from e


def tmp_path_for(path: Path) -> Path:
    """The hidden sibling an output with one writer is written through: the same name on every
    try, so a rerun after a kill overwrites what the killed one left."""
    return path.with_name(f".{path.name}.tmp")


def atomic_write_bytes(path: Path, data: bytes, shared: bool = False) -> None:
    """`data` at `path`, all or nothing, through `tmp_path_for(path)`: a rerun after a kill
    overwrites what the killed write left. `shared`: several processes may rewrite `path` at
    once (the study's parallel evaluations each rebuild eval/report.md), so each writes through
    a temporary file of its own (process and thread) and none renames another's away."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    own = f".{os.getpid()}-{threading.get_ident()}" if shared else ""
    tmp = path.with_name(f".{path.name}{own}.tmp")  # tmp_path_for's name, when not shared
    with writing(path, tmp):
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


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
    """sha256 of a file, read 1 MiB at a time: the one file digest of semix (manifests,
    checkpoints, a local encoder's weights)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
