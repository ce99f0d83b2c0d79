"""Real datasets stored as image files in class folders: any ImageFolder, Tiny-ImageNet and
ImageNet-1k (ILSVRC-2012), as the random-access sources of shards.sources.

Files are listed once, sorted, and decoded on access (PIL, converted to RGB), so a 1.28 M-image
ImageNet costs its file list until prepare reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from shards.manifest import ShardError
from shards.sources import Source, SplitSource, to_rgb

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff")


def hidden(path: Path, under: Path) -> bool:
    """Whether `path` or a folder between `under` and it is hidden (`.ipynb_checkpoints/`,
    `.DS_Store`): such files are a tool's, never the data's."""
    return any(part.startswith(".") for part in path.relative_to(under).parts)


def visible_folders(folder: Path) -> list[str]:
    """The sorted names of `folder`'s subfolders that are not hidden: the class folders."""
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _read_image(path: Path, notes: set[str]) -> np.ndarray:
    try:
        with Image.open(path) as im:
            return to_rgb(im, path, notes)
    except (UnidentifiedImageError, OSError) as e:
        raise ShardError(f"cannot read image {path}: {e}") from e


def _files_split(
    files: Sequence[Path], labels: Sequence[int], notes: set[str] | None = None
) -> SplitSource:
    files, notes = list(files), set(notes or ())
    return SplitSource(
        labels=np.asarray(labels, dtype=np.int64),
        get=lambda i: _read_image(files[i], notes),
        describe=lambda i: str(files[i]),
        notes=notes,
    )


def _class_folder_split(root: Path, class_names: Sequence[str], fix: str = "") -> SplitSource:
    """Every image under root/<class>/ for each class, sorted. Images in sub-folders of a class
    folder are read as that class (a class's photos grouped by where they came from, as
    ImageNet-style trees often are): said once, in the split's notes (prepare logs them), so
    they never join a class unnoticed. `fix`: what to do about a class without a folder."""
    files, labels, nested = [], [], []
    for k, name in enumerate(class_names):
        folder = root / name
        if not folder.is_dir():
            fix = fix.replace("<class>", name) or f"add {folder}/ with images of {name!r}"
            raise ShardError(f"{root} has no folder for class {name!r}: {fix}")
        found = sorted(
            p
            for p in folder.rglob("*")
            if p.suffix.lower() in IMAGE_SUFFIXES and not hidden(p, folder) and p.is_file()
        )
        if not found:
            raise ShardError(f"{folder} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        files += found
        labels += [k] * len(found)
        nested += [p for p in found if p.parent != folder]
    notes = set()
    if nested:
        notes.add(
            f"{len(nested)} images in sub-folders of {root}'s class folders (the first: "
            f"{nested[0]}) are read as the class of the folder above them"
        )
    return _files_split(files, labels, notes)


def _foreign_classes(root: Path, split: str, names: Sequence[str]) -> None:
    """root/<split>/ may only hold classes train/ has: a class the classifier never learns
    cannot be tested, and dropping its images silently would hide that they were never read."""
    extra = sorted(set(visible_folders(root / split)) - set(names))
    if extra:
        listed = ", ".join(extra)
        raise ShardError(
            f"{root / split} has class folders that train/ lacks ({listed}): add them to "
            f"{root / 'train'} or remove them from "
            f"{root / split}"
        )


def imagefolder_source(path: str, class_names: Sequence[str] = ()) -> Source:
    """root/<class>/*.png, or root/{train,val,test}/<class>/*.png (val/ and test/ where they
    exist: prepare carves the missing ones out of train). Class order: the classes file when
    given, else sorted folder names. Hidden folders and files (a name starting with ".") are
    skipped."""
    root = Path(path)
    if path and root.is_file():
        raise ShardError(
            f"data_dir={path} is a file, not a folder: pass the folder that holds the class "
            "folders (an archive unpacked first)"
        )
    if not path or not root.is_dir():
        raise ShardError(f"image folder {path!r} not found; pass data_dir=/path/to/folder")
    base = root / "train" if (root / "train").is_dir() else root
    names = tuple(class_names) or tuple(visible_folders(base))
    if not names:
        raise ShardError(
            f"{base} has no class folders: put each class's images in a folder of its own "
            f"({base}/<class>/*.png), or pass data_dir= the folder that holds them"
        )
    splits = {"train": _class_folder_split(base, names)}
    for split in ("val", "test"):
        if base != root and (root / split).is_dir():
            if not class_names:
                _foreign_classes(root, split, names)
            # a class train/ has and this split lacks: add its folder, or drop the class
            drop = "drop it from the classes file" if class_names else f"remove {base}/<class>"
            fix = f"add {root / split}/<class>/ with its images, or {drop} (every split needs every class)"
            splits[split] = _class_folder_split(root / split, names, fix)
    return Source(class_names=names, splits=splits, origin=root, origin_suffixes=IMAGE_SUFFIXES)


def tiny_imagenet_source(path: str) -> Source:
    """tiny-imagenet-200/: wnids.txt, words.txt, train/<wnid>/images/*.JPEG,
    val/images/*.JPEG + val/val_annotations.txt. The labelled val set serves as test."""
    root = Path(path)
    if not path or not (root / "wnids.txt").is_file():
        raise ShardError(
            f"Tiny-ImageNet not found at {path!r}; download tiny-imagenet-200.zip "
            "(http://cs231n.stanford.edu/tiny-imagenet-200.zip), unzip it and pass data_dir=/path/to/tiny-imagenet-200"
        )
    wnids = [w.strip() for w in (root / "wnids.txt").read_text().splitlines() if w.strip()]
    words = {}
    if (root / "words.txt").is_file():
        for line in (root / "words.txt").read_text().splitlines():
            wnid, _, text = line.partition("\t")
            words[wnid] = text.split(",")[0].strip()
    names = tuple(words.get(w, w) for w in wnids)
    index = {w: k for k, w in enumerate(wnids)}
    train_files, train_labels = [], []
    for w in wnids:
        found = sorted((root / "train" / w / "images").glob("*"))
        train_files += [
            p for p in found if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".")
        ]
        train_labels += [index[w]] * (len(train_files) - len(train_labels))
    splits = {"train": _files_split(train_files, train_labels)}
    ann = root / "val" / "val_annotations.txt"
    if ann.is_file():
        files, labels = [], []
        for line in ann.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) >= 2 and parts[1] in index:
                files.append(root / "val" / "images" / parts[0])
                labels.append(index[parts[1]])
        splits["test"] = _files_split(files, labels)
    return Source(class_names=names, splits=splits, origin=root)


# ---------------------------------------------------------------- ImageNet-1k (ILSVRC-2012)

# files that map a wnid to readable names, looked for in the ImageNet folder: Kaggle's
# "n01440764 tench, Tinca tinca", ImageNet's words.txt / the devkit's synset_words.txt alike
IMAGENET_NAME_FILES = ("LOC_synset_mapping.txt", "words.txt", "synset_words.txt")
IMAGENET_HELP = (
    "expected <data_dir>/train/<wnid>/*.JPEG and <data_dir>/val/<wnid>/*.JPEG (ILSVRC-2012 from "
    "https://image-net.org with the validation images moved into class folders, the layout "
    "torchvision's ImageFolder reads); pass data_dir=/path/to/imagenet"
)


def imagenet_source(path: str) -> Source:
    """ImageNet in class folders: train/<wnid>/*.JPEG, and val/<wnid>/*.JPEG if present (the
    labelled validation set serves as test, as Tiny-ImageNet's does; without val/, prepare
    carves test out of train).

    Class order: the wnid folders of train/, sorted: ImageNet-1k's standard class index, the
    labels DiT and torchvision's models were trained with. Class names: the first name of each
    wnid in a names file of the folder (IMAGENET_NAME_FILES), else the wnid; a name that repeats
    (ImageNet has two "crane"s and two "maillot"s) gets its wnid appended, so names stay unique.
    """
    root = Path(path)
    if not path or not (root / "train").is_dir():
        raise ShardError(f"ImageNet not found at {path!r} (no train/ folder): {IMAGENET_HELP}")
    wnids = tuple(visible_folders(root / "train"))
    if not wnids:
        raise ShardError(f"{root / 'train'} has no class folders: {IMAGENET_HELP}")
    splits = {"train": _class_folder_split(root / "train", wnids)}
    val = root / "val"
    if val.is_dir():
        if not visible_folders(val):
            raise ShardError(
                f"{val} holds no class folders (the raw ILSVRC-2012 layout): move each image into "
                "val/<wnid>/ (the devkit's ground truth names them), or remove val/ to carve test "
                "out of train"
            )
        splits["test"] = _class_folder_split(val, wnids)
    return Source(
        class_names=_imagenet_names(root, wnids),
        splits=splits,
        origin=root,
        origin_suffixes=IMAGE_SUFFIXES,
    )


def _imagenet_names(root: Path, wnids: Sequence[str]) -> tuple[str, ...]:
    words: dict[str, str] = {}
    for name in IMAGENET_NAME_FILES:
        if (root / name).is_file():
            for line in (root / name).read_text(encoding="utf-8").splitlines():
                wnid, _, text = line.strip().partition("\t" if "\t" in line else " ")
                if text.strip():
                    words.setdefault(wnid.strip(), text.split(",")[0].strip())
            break
    names = [words.get(w, w) for w in wnids]
    repeated = {n for n in names if names.count(n) > 1}
    return tuple(f"{n} ({w})" if n in repeated else n for n, w in zip(names, wnids))
