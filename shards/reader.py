"""Read shard folders back: whole split in memory, or streaming through webdataset.

One read path for every stage (`read_raw_shard`): a shard's bytes are read once, their size
and sha256 checked against the manifest's record *before* anything is decoded, then the tar is
parsed and, per folder, the sample count compared with the record. The sha256 costs little
next to PNG decoding (bench/RESULTS.md); users who trust their storage can skip it
(`verify_sha256=0`, set per process by the CLI through `hash_on_read`); size and counts are
always checked.

Every mode refuses a folder without `manifest.json` and decodes only the fields semix
writes (png, cls, json). Members with any other extension, pickles in particular, are
an error: data from shards or the Hub is never unpickled.

`load_split` decodes a shard's PNGs together (`decode_pngs`: one PIL decode of all their rows),
the same pixels as PIL one by one: for small images PIL's per-image work (opening, chunk
parsing, the array copy) is most of a read.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import random
import tarfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import webdataset as wds
from PIL import Image

from core.io import sha256_bytes
from shards.manifest import (
    Manifest,
    ShardError,
    ShardRecord,
    check_digest,
    check_size,
    read_manifest,
    rerun_hint,
)

KNOWN_FIELDS = ("png", "cls", "json")

# Whether readers hash shards by default (the `verify_sha256` config switch; on unless a user
# turns it off). A process-wide default, set by the CLI around one stage like its thread count,
# so that every reader a stage calls obeys it without threading a flag through each call.
_hash_on_read = True


@contextlib.contextmanager
def hash_on_read(enabled: bool) -> Iterator[None]:
    """Within the block, readers called with verify=None hash shards iff `enabled`."""
    global _hash_on_read
    previous, _hash_on_read = _hash_on_read, bool(enabled)
    try:
        yield
    finally:
        _hash_on_read = previous


def hashing(verify: bool | None) -> bool:
    """Whether a reader asked with `verify` hashes: the caller's choice, else the default."""
    return _hash_on_read if verify is None else verify


def decode_png(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        # our PNGs are RGB already: skip the convert copy (a third of the decode time)
        return np.asarray(im if im.mode == "RGB" else im.convert("RGB"), dtype=np.uint8)


def _decode_cls(value: bytes) -> int:
    text = value.decode("ascii")  # a pickle or other binary fails here, before int()
    if not text.strip().lstrip("-").isdigit():
        raise ValueError(f"{text[:20]!r} is not an integer")
    return int(text)


# member type -> (decoded field, decoder); decoding is all these do: no member can run code
_DECODERS = {
    "png": ("image", decode_png),
    "cls": ("cls", _decode_cls),
    "json": ("meta", lambda value: json.loads(value.decode("utf-8"))),
}


def decode_sample(raw: dict[str, Any]) -> dict[str, Any]:
    """webdataset raw sample (bytes per extension) -> {key, image, cls, meta}."""
    url = raw.get("__url__", "?")
    sample: dict[str, Any] = {"__key__": raw["__key__"], "__url__": url}
    for field, value in raw.items():
        if field.startswith("__"):
            continue
        if field not in _DECODERS:
            raise ShardError(
                f"{url}: sample {raw['__key__']!r} has a member of type {field!r}; semix only "
                f"reads {', '.join(KNOWN_FIELDS)} and never decodes other (e.g. pickled) members"
            )
        name, decode = _DECODERS[field]
        try:
            sample[name] = decode(value)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            # PIL reports broken PNG data as OSError/SyntaxError; a pickle in .cls as a codec error
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ShardError(
                f"{url}: the {field} member of sample {raw['__key__']!r} does not decode "
                f"({first}); the shard is damaged: {rerun_hint('', Path(url).parent)}"
            ) from e
    return sample


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_stream(data: bytes) -> tuple[tuple[int, int, int], bytes] | None:
    """((height, width, channels), the zlib stream of its IDAT chunks) of a PNG the batched
    decoder takes: 8-bit RGB or grey, not interlaced, no other critical chunk (no palette).
    None for any other PNG and anything malformed: PIL then decodes it, or says what is wrong."""
    if not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR" or len(data) < 33:
        return None
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    depth, colour, method, filtering, interlace = data[24:29]
    if depth != 8 or colour not in (0, 2) or method or filtering or interlace:
        return None
    if not width or not height:
        return None
    idat, off = [], 8
    while off + 12 <= len(data):
        size, kind = int.from_bytes(data[off : off + 4], "big"), data[off + 4 : off + 8]
        if kind == b"IDAT":
            idat.append(data[off + 8 : off + 8 + size])
        elif kind == b"IEND":
            return (height, width, 3 if colour == 2 else 1), b"".join(idat)
        elif not kind[0] & 0x20 and kind != b"IHDR":  # critical (upper case): PLTE, ...
            return None
        off += 12 + size
    return None  # no IEND: truncated


def decode_pngs(payloads: Sequence[bytes]) -> np.ndarray | None:
    """uint8 [n, H, W, 3] of PNGs of one size and kind, decoded together: the pixels decode_png
    gives one by one (grey repeated to RGB, as its convert does), several times faster for small
    images, whose cost with PIL is mostly per image (opening, chunk parsing, the array copy).

    1. Each PNG's IDAT stream (`_png_stream`), inflated by zlib: H rows of a filter byte and
       W·channels filtered bytes.
    2. The rows of all images one after the other, each image after a row of zeros with filter 0
       (None): the rows above an image's first row are then zeros, as the PNG filters assume,
       and no image's filters reach into another's.
    3. That stream, stored in zlib without compression, decoded as one tall image by PIL's own
       PNG row decoder (Image.frombytes with the "zip" decoder, which undoes the filters); the
       zero rows dropped.
    None when any PNG is not one `_png_stream` takes, they differ in size or kind, or a stream
    does not inflate to exactly its rows: the caller then decodes one by one (PIL), which names
    a damaged image as before.
    """
    parsed = [_png_stream(p) for p in payloads]
    if not parsed or any(p is None for p in parsed) or len({p[0] for p in parsed}) != 1:
        return None
    (height, width, channels), n = parsed[0][0], len(parsed)
    try:
        rows = [zlib.decompress(stream) for _, stream in parsed]
    except zlib.error:
        return None
    if any(len(r) != height * (1 + width * channels) for r in rows):
        return None
    gap = bytes(1 + width * channels)  # filter 0, zeros
    stream = zlib.compress(b"".join(gap + r for r in rows), 0)
    mode = "RGB" if channels == 3 else "L"
    try:
        tall = Image.frombytes(mode, (width, n * (height + 1)), stream, "zip", mode)
    except (OSError, ValueError):  # not expected for rows of the right length: PIL decides
        return None
    images = np.asarray(tall, dtype=np.uint8).reshape(n, height + 1, width, channels)[:, 1:]
    return np.repeat(images, 3, axis=3) if channels == 1 else np.ascontiguousarray(images)


def decode_samples(raws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """decode_sample of each raw sample, their PNGs decoded together (decode_pngs) when all take
    its path; every other field decoded (and checked) as decode_sample does."""
    pngs = [raw.get("png") for raw in raws]
    images = None
    if pngs and all(isinstance(p, bytes) for p in pngs):
        images = decode_pngs(pngs)
    if images is None:
        return [decode_sample(raw) for raw in raws]
    samples = []
    for raw, image in zip(raws, images):
        sample = decode_sample({k: v for k, v in raw.items() if k != "png"})
        sample["image"] = image
        samples.append(sample)
    return samples


BLOCK = 512  # tar block: headers are one block, payloads padded to whole blocks


class NotPlainUstar(Exception):
    """A member the fast path does not handle (pax/GNU headers, links, ...): use tarfile."""


def _octal(field: bytes) -> int:
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def ustar_header(header: bytes, path: Path, off: int) -> tuple[str, int] | None:
    """(member name, payload size) of the plain-ustar header block at byte `off` of `path`;
    None at the end-of-archive marker. A bad checksum is a ShardError; a header the fast
    readers do not handle (pax/GNU, links, a name prefix) raises NotPlainUstar."""
    if header.count(0) == BLOCK:
        return None
    if _octal(header[148:156]) != sum(header[:148]) + 8 * 32 + sum(header[156:]):
        raise ShardError(f"{path} is damaged (bad tar header checksum at byte {off})")
    if header[156:157] not in (b"0", b"\0") or header[345:346] != b"\0":
        raise NotPlainUstar
    return header[:100].split(b"\0", 1)[0].decode("utf-8"), _octal(header[124:136])


def padded(size: int) -> int:
    """Bytes a payload of `size` takes in a tar (whole blocks)."""
    return -(-size // BLOCK) * BLOCK


def _fast_members(data: bytes, path: Path) -> Iterator[tuple[str, bytes]]:
    """(name, payload) of a plain ustar archive, parsed straight from the bytes.

    Our shards are plain ustar (short names, regular files only), and for small images the
    stdlib's tarfile spends more time on headers than PIL spends decoding: this path reads
    them ~7x faster. Anything unusual raises NotPlainUstar and the caller falls back.
    """
    off = 0
    while off + BLOCK <= len(data):
        parsed = ustar_header(data[off : off + BLOCK], path, off)
        if parsed is None:
            return  # end-of-archive marker
        name, size = parsed
        start = off + BLOCK
        if start + size > len(data):
            raise ShardError(
                f"{path} is truncated inside {name!r}; {rerun_hint('', Path(path).parent)}"
            )
        yield name, data[start : start + size]
        off = start + padded(size)
    raise ShardError(
        f"{path} is truncated (no end-of-archive marker); {rerun_hint('', Path(path).parent)}"
    )


def _tarfile_members(data: bytes, path: Path) -> Iterator[tuple[str, bytes]]:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                if member.isfile():
                    payload = tar.extractfile(member).read()
                    if len(payload) != member.size:
                        raise ShardError(f"{path} is truncated inside {member.name!r}")
                    yield member.name, payload
    except (tarfile.TarError, EOFError) as e:
        raise ShardError(f"{path} is damaged ({e}); {rerun_hint('', Path(path).parent)}") from e


def read_shard_bytes(
    path: Path, rec: ShardRecord | None = None, *, kind: str = "", verify: bool | None = None
) -> bytes:
    """The bytes of one shard, checked against its record (size always, sha256 if hashing).

    The bytes are in memory anyway, so hashing them costs one pass of sha256 and no extra I/O.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ShardError(
            f"cannot read shard {path}: {e.strerror or e}; {rerun_hint(kind, Path(path).parent)}"
        ) from e
    if rec is not None:
        check_size(Path(path), len(data), rec, kind)
        if hashing(verify):
            check_digest(Path(path), sha256_bytes(data), rec, kind)
    return data


def read_raw_shard(
    path: Path, rec: ShardRecord | None = None, *, kind: str = "", verify: bool | None = None
) -> list[dict[str, Any]]:
    """Undecoded samples of one tar, in file order: {__key__, __url__, ext: bytes, ...}.

    With `rec` (the shard's manifest record) the bytes are checked before parsing, and the
    sample count after. For stages that pass members through unchanged (annotate copies the
    series PNG bytes), and under every other reader here.
    """
    data = read_shard_bytes(path, rec, kind=kind, verify=verify)
    try:
        members = list(_fast_members(data, path))
    except NotPlainUstar:
        members = list(_tarfile_members(data, path))
    samples: list[dict[str, Any]] = []
    for name, payload in members:
        key, _, ext = Path(name).name.partition(".")
        if not samples or samples[-1]["__key__"] != key:
            samples.append({"__key__": key, "__url__": str(path)})
        samples[-1][ext] = payload
    if rec is not None and len(samples) != rec.count:
        raise ShardError(
            f"{path}: {len(samples)} samples, manifest says {rec.count} (truncated?); "
            f"{rerun_hint(kind, Path(path).parent)}"
        )
    return samples


def iter_shard(
    path: Path, rec: ShardRecord | None = None, *, kind: str = "", verify: bool | None = None
) -> Iterator[dict[str, Any]]:
    """Decoded samples of one tar, in file order. Raises ShardError naming a damaged shard."""
    for raw in read_raw_shard(path, rec, kind=kind, verify=verify):
        yield decode_sample(raw)


@dataclass
class Split:
    """A whole shard folder in memory: images uint8 [N, H, W, 3], labels int64 [N]."""

    images: torch.Tensor
    labels: torch.Tensor
    keys: list[str]
    meta: list[dict[str, Any]]
    manifest: Manifest

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.manifest.class_names

    def __len__(self) -> int:
        return len(self.keys)


def iter_folder(folder: Path, verify: bool | None = None) -> Iterator[dict[str, Any]]:
    """Every sample of a complete folder, shard by shard, in manifest order; each shard is
    checked against its manifest record before use (`verify`: hash too; None = the default)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    for rec in manifest.shards:
        yield from iter_shard(folder / rec.name, rec, kind=manifest.kind, verify=verify)


def load_split(folder: Path, verify: bool | None = None) -> Split:
    """Load a whole folder into memory (small datasets: CIFAR-size and below)."""
    manifest = read_manifest(folder)
    images, labels, keys, meta = [], [], [], []
    # iter_folder's shards, each checked before use, their PNGs decoded together (decode_samples)
    shards = (
        read_raw_shard(Path(folder) / rec.name, rec, kind=manifest.kind, verify=verify)
        for rec in manifest.shards
    )
    for s in (sample for raws in shards for sample in decode_samples(raws)):
        if "image" not in s:
            raise ShardError(f"{s['__url__']}: sample {s['__key__']!r} has no png image")
        images.append(s["image"])
        labels.append(s.get("cls", -1))
        keys.append(s["__key__"])
        meta.append(s.get("meta", {}))
    if not images:
        raise ShardError(f"{folder} holds no samples")
    shapes = {im.shape for im in images}
    if len(shapes) != 1:
        raise ShardError(f"{folder}: images of different sizes {sorted(shapes)}")
    return Split(
        images=torch.from_numpy(np.stack(images)),
        labels=torch.tensor(labels, dtype=torch.int64),
        keys=keys,
        meta=meta,
        manifest=manifest,
    )


def _read_shards(
    shards: Iterator[dict[str, Any]], *, records: dict[str, ShardRecord], kind: str, verify: bool
) -> Iterator[dict[str, Any]]:
    """webdataset pipeline stage: shard urls -> raw samples, each shard checked first."""
    for shard in shards:
        url = shard["url"]
        yield from read_raw_shard(url, records[url], kind=kind, verify=verify)


def stream(
    folder: Path,
    *,
    shuffle_buffer: int = 0,
    seed: int = 0,
    shuffle_shards: bool = False,
    verify: bool | None = None,
) -> wds.DataPipeline:
    """Streaming reader for large folders: shards split by node (rank) and by worker.

    Returns a webdataset pipeline of decoded samples; wrap it in a torch DataLoader. Shards are
    read through `read_raw_shard`, so each is checked against the manifest like in memory.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    records = {str(folder / rec.name): rec for rec in manifest.shards}
    # hashing fixed now: spawned worker processes do not inherit this process' default
    read = functools.partial(
        _read_shards, records=records, kind=manifest.kind, verify=hashing(verify)
    )
    stages: list[Any] = [
        wds.SimpleShardList(list(records), seed=seed if shuffle_shards else None),
        wds.split_by_node,
        wds.split_by_worker,
        read,
        wds.map(decode_sample),
    ]
    if shuffle_buffer > 0:
        stages.append(wds.shuffle(shuffle_buffer, rng=random.Random(seed)))
    return wds.DataPipeline(*stages)
