"""What prepare read: a fingerprint of its source's files, so that a rerun against data that
changed since stops in one line instead of calling the old shards complete.

An archive (a CIFAR tarball) is its size and sha256; named files in a folder (the four MNIST
files) are each file's size and sha256. A folder (an ImageFolder, Tiny-ImageNet, ImageNet) is,
per subfolder: how many files (of the given suffixes, when the reader reads only those), their
bytes, a digest of their names and sizes, and a digest of their contents. Hashing every byte costs a read of the whole
dataset, so contents are hashed up to CONTENT_LIMIT bytes in all; a bigger folder (ImageNet) is
fingerprinted by names and sizes only. Hidden files and folders (a name starting with ".") are
a tool's, not the data's, and are left out, as the readers leave them out.

    fp = fingerprint(Path("/data/pets"))   # {"kind": "folder", "folders": {"train/cat": {...}}}
    changes(old_fp, fp)                    # ["3 more files under train/cat (40 -> 43)"]
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.io import canonical_json, sha256_bytes, sha256_file

CONTENT_LIMIT = 2 * 2**30  # bytes whose contents a fingerprint hashes; above: names and sizes
SHOWN = 3  # changes a message names; the rest are counted


def _files(root: Path, suffixes: Sequence[str]) -> list[tuple[str, str, int]]:
    """(subfolder relative to root, file name, bytes) of every visible file (of `suffixes`,
    when given), sorted."""
    found = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        if suffixes and path.suffix.lower() not in suffixes:
            continue
        found.append((rel.parent.as_posix(), rel.name, path.stat().st_size))
    return sorted(found)


def _file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {"bytes": None, "sha256": ""}
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def fingerprint(
    origin: Path, names: Sequence[str] = (), suffixes: Sequence[str] = ()
) -> dict[str, Any]:
    """The fingerprint of a file, of the files `names` in the folder `origin`, or of the folder
    (its files of `suffixes`, when given) (module docstring)."""
    origin = Path(origin)
    if origin.is_file():
        return {"kind": "file", **_file(origin)}
    if names:
        return {"kind": "files", "files": {name: _file(origin / name) for name in sorted(names)}}
    files = _files(origin, suffixes)
    hash_contents = sum(size for _, _, size in files) <= CONTENT_LIMIT
    folders: dict[str, dict[str, Any]] = {}
    listing: dict[str, Any] = {}
    contents: dict[str, Any] = {}
    for folder, name, size in files:
        entry = folders.setdefault(folder, {"files": 0, "bytes": 0})
        entry["files"] += 1
        entry["bytes"] += size
        listing.setdefault(folder, hashlib.sha256()).update(f"{name}\t{size}\n".encode())
        if hash_contents:
            digest = sha256_file(origin / folder / name)
            contents.setdefault(folder, hashlib.sha256()).update(f"{name}\t{digest}\n".encode())
    for folder, entry in folders.items():
        entry["listing"] = listing[folder].hexdigest()
        entry["content"] = contents[folder].hexdigest() if hash_contents else ""
    return {"kind": "folder", "folders": folders}


def digest(fp: dict[str, Any]) -> str:
    """sha256 of a fingerprint (what a manifest pins)."""
    return sha256_bytes(canonical_json(fp))


def changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints of one source, in words; [] when nothing does."""
    if old.get("kind") != new.get("kind"):
        return [f"it was a {old.get('kind')}, it is now a {new.get('kind')}"]
    if old["kind"] == "file":
        return _file_changes("", old, new)
    if old["kind"] == "files":
        return [
            said
            for name in sorted(old["files"].keys() | new["files"].keys())
            for said in _file_changes(
                f"{name}: ", old["files"].get(name, {}), new["files"].get(name, {})
            )
        ]
    said = []
    before, after = old["folders"], new["folders"]
    for folder in sorted(before.keys() | after.keys()):
        was, now = before.get(folder), after.get(folder)
        where = "the top folder" if folder == "." else f"{folder}/"
        if was is None:
            said.append(f"{where} added ({now['files']} files)")
        elif now is None:
            said.append(f"{where} removed ({was['files']} files)")
        elif now["files"] != was["files"]:
            more = now["files"] - was["files"]
            what = f"{more} more files" if more > 0 else f"{-more} fewer files"
            said.append(f"{what} under {where} ({was['files']} -> {now['files']})")
        elif now["listing"] != was["listing"]:
            said.append(f"files renamed or resized under {where}")
        elif now["content"] and was["content"] and now["content"] != was["content"]:
            said.append(f"file contents changed under {where}")
    return said


def _file_changes(name: str, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    if old.get("bytes") != new.get("bytes"):
        if new.get("bytes") is None:
            return [f"{name}removed"]
        return [f"{name}size changed ({old.get('bytes')} -> {new['bytes']} bytes)"]
    if old.get("sha256") != new.get("sha256"):
        return [f"{name}contents changed (another sha256)"]
    return []


def summary(said: list[str]) -> str:
    """The first SHOWN changes, and how many more."""
    more = f" and {len(said) - SHOWN} more" if len(said) > SHOWN else ""
    return "; ".join(said[:SHOWN]) + more
