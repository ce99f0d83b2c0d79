"""Real datasets on local disk (or the Hub) as random-access (image, label) sequences.

Every source yields uint8 HxWx3 RGB arrays and integer labels, plus its class names and
its official splits ("train", and "test" where the dataset has one). The prepare stage
derives val (and test, where missing) from train deterministically, then writes shards.

Supported: scikit-learn's bundled digits (offline), the MNIST family's IDX files, the CIFAR python
archives, Hugging Face `datasets`; image files in class folders (any ImageFolder, Tiny-ImageNet,
ImageNet-1k) are in shards/image_folders.py. Which dataset reads which, and from where (class
names, archive layouts, a Debian package's folder), is the presets' to say (stages/presets/):
they pass it in.
"""

from __future__ import annotations

import gzip
import io
import pickle
import tarfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from core.hub import hub_offline
from shards.manifest import ShardError


@dataclass(frozen=True)
class SplitSource:
    """A random-access split: `get(i) -> (uint8 HxWx3, label)`; `describe(i)` names item i.
    `notes`: how the images were changed to become uint8 RGB (grey to RGB, 16 bits to 8), each
    said once; `get` may add to them as it meets new kinds of image."""

    labels: np.ndarray  # int64 [N], known up front so splits can be stratified
    get: Callable[[int], np.ndarray]
    describe: Callable[[int], str]
    notes: set[str] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class Source:
    class_names: tuple[str, ...]
    # "train" always; "test" (and "val") when the dataset has them
    splits: dict[str, SplitSource]
    # the file or folder the data were read from (prepare fingerprints it); None for data that
    # come with a library (scikit-learn's digits) or from the Hub
    origin: Path | None = None
    # what in the folder `origin` the data are: these files only (the MNIST files), or the files
    # of these suffixes (an ImageFolder's images); both empty: every file under it
    origin_files: tuple[str, ...] = ()
    origin_suffixes: tuple[str, ...] = ()


# PIL's 16-bit grey modes (and "I", which older Pillows and some TIFFs use for them): their
# values span 0..65535, which PIL's convert("RGB") clips to 255 instead of scaling
SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def to_rgb(im: Any, path: Path | str, notes: set[str]) -> np.ndarray:
    """uint8 HxWx3 of any PIL image, by its real range: 16-bit grey scaled by 255/65535, a
    float image (mode F, no fixed range) refused by name. Each conversion goes into `notes`
    (prepare says each once)."""
    if im.mode in SIXTEEN_BIT:
        grey = np.asarray(im).astype(np.int64)
        if grey.size and (grey.min() < 0 or grey.max() > 65535):
            raise ShardError(
                f"{path}: a {im.mode} image with values outside 0..65535; save it with 8 or 16 "
                "bits per channel"
            )
        notes.add(f"16-bit grey images (PIL mode {im.mode}) scaled to 8 bits (x 255/65535), as RGB")
        grey8 = np.round(grey * (255 / 65535)).astype(np.uint8)
        return np.repeat(grey8[..., None], 3, axis=-1)
    if im.mode == "F":
        raise ShardError(
            f"{path}: a 32-bit float image (PIL mode F) has no fixed range to map to 0..255; "
            "save it with 8 or 16 bits per channel"
        )
    if im.mode != "RGB":
        notes.add(f"images of PIL mode {im.mode} converted to RGB")
    return np.asarray(im.convert("RGB"), dtype=np.uint8)


# ---------------------------------------------------------------- scikit-learn's digits (offline)


def digits_source(_: str = "") -> Source:
    """scikit-learn's 1,797 real 8x8 handwritten digits (values 0..16), as grey RGB."""
    from sklearn.datasets import load_digits

    d = load_digits()
    pixels = np.round(d.images * (255.0 / 16.0)).astype(np.uint8)  # [N, 8, 8]
    rgb = np.repeat(pixels[..., None], 3, axis=-1)
    labels = d.target.astype(np.int64)
    grey = {"grey images (0..16) scaled to 0..255 and repeated to RGB"}
    split = SplitSource(
        labels=labels, get=lambda i: rgb[i], describe=lambda i: f"digits[{i}]", notes=grey
    )
    return Source(class_names=tuple(str(k) for k in range(10)), splits={"train": split})


# ---------------------------------------------------------------- IDX files (the MNIST family)

_IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_IDX_UBYTE = 0x08  # the only element type the MNIST family uses


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (LeCun's MNIST format, optionally gzipped) as a uint8 array.

    Header: two zero bytes, the element type (0x08 = unsigned byte), the number of dimensions
    d, then d big-endian uint32 sizes; the data follow, row-major.
    """
    try:
        raw = path.read_bytes()
        data = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise ShardError(f"cannot read IDX file {path}: {e}") from e
    if len(data) < 4 or data[:2] != b"\0\0" or data[2] != _IDX_UBYTE:
        raise ShardError(f"{path} is not an unsigned-byte IDX file (bad magic number)")
    ndim = data[3]
    header = 4 + 4 * ndim
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    if len(data) != header + int(np.prod(shape, dtype=np.int64)):
        raise ShardError(f"{path}: {len(data) - header} data bytes, its header says {shape}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def _idx_file(folder: Path, stem: str) -> Path | None:
    for name in (f"{stem}.gz", stem):
        if (folder / name).is_file():
            return folder / name
    return None


def idx_source(folder: Path, class_names: Sequence[str]) -> Source:
    """The four MNIST-layout files (train/t10k images + labels, .gz or not) in `folder`."""
    splits, read = {}, []
    for split, (image_stem, label_stem) in _IDX_FILES.items():
        image_path, label_path = _idx_file(folder, image_stem), _idx_file(folder, label_stem)
        if image_path is None or label_path is None:
            raise ShardError(f"{folder} lacks {image_stem}.gz or {label_stem}.gz")
        read += [image_path.name, label_path.name]
        images, labels = read_idx(image_path), read_idx(label_path).astype(np.int64)
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ShardError(
                f"{image_path} {images.shape} and {label_path} {labels.shape} do not match "
                "(expected [N, H, W] images and [N] labels)"
            )
        if len(labels) and (labels.min() < 0 or labels.max() >= len(class_names)):
            raise ShardError(f"{label_path}: labels outside 0..{len(class_names) - 1}")

        def get(i: int, images: np.ndarray = images) -> np.ndarray:
            return np.repeat(images[i][..., None], 3, axis=-1)  # grey -> RGB, as digits

        splits[split] = SplitSource(
            labels=labels,
            get=get,
            describe=lambda i, p=image_path: f"{p.name}[{i}]",
            notes={"grey images repeated to RGB"},
        )
    return Source(
        class_names=tuple(class_names), splits=splits, origin=folder, origin_files=tuple(read)
    )


def has_idx_files(folder: Path) -> bool:
    """Whether `folder` holds the training images of the MNIST layout (.gz or not)."""
    return _idx_file(folder, _IDX_FILES["train"][0]) is not None


# ---------------------------------------------------------------- CIFAR python archives


class _ArrayUnpickler(pickle.Unpickler):
    """The CIFAR archives are pickles of dicts of lists and numpy arrays. Allow exactly the
    numpy reconstruction globals those need and nothing else, so a tampered archive cannot
    run code."""

    _ALLOWED = frozenset(
        {
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
            ("_codecs", "encode"),  # how Python 3 pickles bytes at protocol 2
        }
    )

    def find_class(self, module: str, name: str):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _load_pickled(data: bytes, where: str) -> dict:
    try:
        obj = _ArrayUnpickler(io.BytesIO(data), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
        raise ShardError(f"{where} is not a valid CIFAR batch: {e}") from e
    if not isinstance(obj, dict):
        raise ShardError(f"{where} is not a valid CIFAR batch (not a dict)")
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in obj.items()}


class CifarLayout(NamedTuple):
    """What one of the CIFAR python archives holds, and the columns of its Hub copy."""

    name: str  # how the errors name the dataset
    archive: str  # the official file name
    train_members: tuple[str, ...]
    test_member: str
    meta_member: str
    label_key: str
    names_key: str
    hf_columns: tuple[str, str]  # (image, label) of its Hugging Face `datasets` copy


def cifar_source(layout: CifarLayout, data_dir: str, hf_dataset: str) -> Source:
    """The archive at `data_dir` (the file or its folder), else the `datasets` copy."""
    if data_dir:
        return cifar_archive_source(layout, data_dir)
    if hf_dataset:
        return hf_source(hf_dataset, *layout.hf_columns)
    raise ShardError(
        f"{layout.name}: set data_dir=/path/to/the/python-archive or hf_dataset=<id or folder>"
    )


def cifar_archive_source(layout: CifarLayout, path: str) -> Source:
    variant, archive_name, train_members, test_member, meta_member, label_key, names_key, _ = layout
    archive = Path(path)
    if archive.is_dir():
        archive = archive / archive_name
    if not archive.is_file():
        raise ShardError(
            f"{variant} archive not found at {archive}; download {archive_name} from "
            "https://www.cs.toronto.edu/~kriz/cifar.html and pass data_dir=/path/to/it"
        )
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}

            def read(name: str) -> dict:
                if name not in members:
                    raise ShardError(
                        f"{archive} has no member {name!r}: not an official {archive_name}"
                    )
                return _load_pickled(tar.extractfile(members[name]).read(), f"{archive}:{name}")

            meta = read(meta_member)
            train = [read(m) for m in train_members]
            test = read(test_member)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ShardError(f"{archive} is corrupt or not a tar archive ({e})") from e

    names = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in meta[names_key])

    def split(batches: list[dict], tag: str) -> SplitSource:
        data = np.concatenate([np.asarray(b["data"], dtype=np.uint8) for b in batches])
        if data.ndim != 2 or data.shape[1] != 3072:
            raise ShardError(f"{archive}: {tag} data has shape {data.shape}, expected [N, 3072]")
        images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # CHW planes -> HWC
        labels = np.concatenate([np.asarray(b[label_key], dtype=np.int64) for b in batches])
        if len(labels) != len(images) or labels.min() < 0 or labels.max() >= len(names):
            raise ShardError(f"{archive}: {tag} labels do not match the data or the class list")
        return SplitSource(
            labels=labels, get=lambda i: images[i], describe=lambda i: f"{archive.name}:{tag}[{i}]"
        )

    return Source(
        class_names=names,
        splits={"train": split(train, "train"), "test": split([test], "test")},
        origin=archive,
    )


# ---------------------------------------------------------------- Hugging Face datasets


def hf_source(dataset_id: str, image_col: str = "image", label_col: str = "label") -> Source:
    """A Hub dataset id (needs network) or a local folder `datasets` can load; the label column
    is a ClassLabel (its names are the class names)."""
    import datasets

    offline = not Path(dataset_id).exists() and hub_offline()
    if offline:  # the local cache only: no timeouts and retries before the one line
        datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        dd = datasets.load_dataset(dataset_id)
    except (OSError, ConnectionError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
        why = "the Hub is offline and it is not in the local cache" if offline else type(e).__name__
        raise ShardError(
            f"could not load {dataset_id} with Hugging Face datasets ({why}); "
            "pass data_dir=/path/to/the/python-archive (or hf_dataset=/local/folder)"
        ) from e
    train = dd["train"]
    features = train.features
    if image_col not in features or label_col not in features:
        raise ShardError(
            f"{dataset_id} has columns {list(features)}, expected {image_col!r} and {label_col!r}"
        )
    names = tuple(features[label_col].names)

    def split(ds, tag: str) -> SplitSource:
        labels, notes = np.asarray(ds[label_col], dtype=np.int64), set()
        return SplitSource(
            labels=labels,
            get=lambda i: to_rgb(ds[i][image_col], f"{dataset_id}:{tag}[{i}]", notes),
            describe=lambda i: f"{dataset_id}:{tag}[{i}]",
            notes=notes,
        )

    splits = {"train": split(train, "train")}
    if "test" in dd:
        splits["test"] = split(dd["test"], "test")
    return Source(class_names=names, splits=splits)
