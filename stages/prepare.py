"""prepare: a real dataset -> runs/<classes>/real/{train,val,test}/ as WebDataset shards.

    python -m pipeline prepare --preset digits
    python -m pipeline prepare --preset cifar100 --set data_dir=/data/cifar-100-python.tar.gz

Every split folder gets shards, completion records and, last, its manifest. Reruns skip
complete shards, so a killed run resumes to the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from core.io import atomic_write_json, read_json
from core.logs import log, progress
from core.seeding import make_generator
from core.version import code_version
from shards.fingerprint import changes, digest, fingerprint, summary
from shards.manifest import ShardError
from shards.sources import Source, SplitSource
from shards.writer import ShardFolder, claimed, completed, replace_incomplete, write_config
from stages.configs.prepare import Config
from stages.presets import reader

SPLITS = ("train", "val", "test")
# real/source.json: where the data were read from and their fingerprint (shards/fingerprint.py)
SOURCE_RECORD = "source.json"


def stratified_split(
    labels: np.ndarray, fraction: float, generator: torch.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held_out) index arrays: `fraction` of every class held out, seeded, sorted."""
    held = []
    for k in np.unique(labels):
        idx = np.flatnonzero(labels == k)
        perm = torch.randperm(len(idx), generator=generator).numpy()
        # at least one per class when holding out anything, so tiny datasets get a usable val
        n_held = max(1, round(fraction * len(idx))) if fraction > 0 and len(idx) > 1 else 0
        held.append(idx[perm[:n_held]])
    held_out = np.sort(np.concatenate(held)) if held else np.zeros(0, dtype=np.int64)
    kept = np.setdiff1d(np.arange(len(labels)), held_out)
    return kept, held_out


def plan_splits(source: Source, cfg: Config) -> dict[str, tuple[SplitSource, np.ndarray]]:
    """split name -> (source split, indices into it): the source's own val and test where it
    has them, else carved out of train. Deterministic given the seed."""
    train = source.splits["train"]
    train_idx = np.arange(len(train))
    if "test" in source.splits:
        test = (source.splits["test"], np.arange(len(source.splits["test"])))
    else:
        keep, held = stratified_split(
            train.labels, cfg.test_fraction, make_generator(cfg.seed, "test-split")
        )
        train_idx, test = keep, (train, held)
    if "val" in source.splits:
        val = (source.splits["val"], np.arange(len(source.splits["val"])))
        return {"train": (train, train_idx), "val": val, "test": test}
    keep, held = stratified_split(
        train.labels[train_idx], cfg.val_fraction, make_generator(cfg.seed, "val-split")
    )
    return {"train": (train, train_idx[keep]), "val": (train, train_idx[held]), "test": test}


def _squash(image: np.ndarray, size: int) -> np.ndarray:
    """Both sides to `size` (bicubic): the aspect ratio is not kept."""
    return np.asarray(Image.fromarray(image).resize((size, size), Image.Resampling.BICUBIC))


def _center_crop(image: np.ndarray, size: int) -> np.ndarray:
    """The shorter side to `size` (bicubic, PIL's antialiasing), then the central size x size:
    the aspect ratio is kept (ImageNet's photos are mostly 4:3)."""
    im = Image.fromarray(image)
    scale = size / min(im.size)
    w, h = max(size, round(im.width * scale)), max(size, round(im.height * scale))
    im = im.resize((w, h), Image.Resampling.BICUBIC)
    left, top = (w - size) // 2, (h - size) // 2
    return np.asarray(im.crop((left, top, left + size, top + size)))


RESIZERS = {"squash": _squash, "center-crop": _center_crop}


def _samples(
    split: str, src: SplitSource, indices: np.ndarray, size: int, resize: str, bar, said: set
) -> Iterator[dict]:
    """Sample dicts for the writer; every image comes out size x size RGB or we stop, naming it.
    `resize` names a RESIZERS entry, "" = refuse images of another size. How images change on
    the way (a resize, grey or 16 bits to 8-bit RGB) is logged once a run (`said`)."""
    for i in indices:
        image = src.get(int(i))
        for note in sorted(src.notes - said):
            log.info("prepare: %s", note)
            said.add(note)
        if image.ndim != 3 or image.shape[2] != 3:
            raise ShardError(
                f"{src.describe(int(i))}: expected an RGB image, got shape {image.shape}"
            )
        if image.shape[:2] != (size, size):
            if not resize:
                raise ShardError(
                    f"{src.describe(int(i))} is {image.shape[1]}x{image.shape[0]}, others {size}x{size}: "
                    "set image_size=N to resize everything"
                )
            if "resize" not in said:
                log.info(
                    "prepare: images resized to %dx%d (%s; the first: %s, %dx%d)",
                    *(size, size, resize, src.describe(int(i)), image.shape[1], image.shape[0]),
                )
                said.add("resize")
            image = RESIZERS[resize](image, size)
        bar.update(1)
        # key = split + index into the source split: stable, unique, no dots
        yield {"__key__": f"{split}_{int(i):07d}", "png": image, "cls": int(src.labels[i])}


def already_complete(cfg: Config, real: Path) -> bool:
    """Every split has its manifest (and the config matches, and the source has not changed): a
    rerun only reads, so it works on read-only media and without the source dataset at hand."""
    if not all(completed(real / split) for split in SPLITS):
        return False
    write_config(real, cfg.recorded(), parts=SPLITS)  # compares only: refuses another config
    check_source(real)
    log.info("prepare: %s is complete already", real)
    return True


def check_source(real: Path) -> bool:
    """Refuse, in one line, to go on with a root whose source changed since prepare read it
    (SOURCE_RECORD holds its fingerprint). A root without one (prepared before fingerprints)
    and a source that is not at hand are not compared. A root that never completed a split
    holds nobody's data: it is replaced (one line says so) and False returned, so the caller
    starts it again (a file removed after a failed read is the fix, never a refusal)."""
    path = real / SOURCE_RECORD
    if not path.is_file():
        return True
    recorded = read_json(path)
    origin = Path(recorded["origin"])
    if not origin.exists():
        log.info("prepare: %s is not at hand; %s not compared with it", origin, real)
        return True
    now = fingerprint(origin, recorded.get("files", ()), recorded.get("suffixes", ()))
    said = changes(recorded["fingerprint"], now)
    if said and not claimed(real, SPLITS):
        replace_incomplete(
            real, f"{origin} changed since it was read ({summary(said)}), no split had completed"
        )
        return False
    if said:
        raise ShardError(
            f"{origin} changed since {real} was prepared from it ({summary(said)}); its shards "
            "hold the data as they were: prepare the new data into another root (--set "
            f"name=NEW or out=/another/folder), or remove {real} to prepare it again here"
        )
    return True


def record_source(real: Path, source: Source) -> dict[str, str]:
    """SOURCE_RECORD, before any shard (what a rerun compares the source with), and the manifest
    info that pins it; {} for data that come with a library or from the Hub (no file of theirs
    can change under a root)."""
    if source.origin is None:
        return {}
    path = real / SOURCE_RECORD
    if not path.is_file():
        read = {"files": list(source.origin_files), "suffixes": list(source.origin_suffixes)}
        fp = fingerprint(source.origin, source.origin_files, source.origin_suffixes)
        record = {"origin": str(source.origin), **read, "fingerprint": fp}
        atomic_write_json(path, record)
    return {"source_sha256": digest(read_json(path)["fingerprint"])}


def check_classes(source: Source, where: str) -> None:
    """A classifier needs two classes at least (one class would train to 100 % accuracy)."""
    names = source.class_names
    if len(names) < 2:
        raise ShardError(
            f"{where} has {len(names)} class{'' if len(names) == 1 else 'es'} "
            f"({', '.join(names) or 'none'}): a classifier needs 2 or more; add a folder per class"
        )


# images every class needs in every split: one, so that each split measures every class
MIN_PER_CLASS = 1


def check_splits(
    splits: dict[str, tuple[SplitSource, np.ndarray]],
    class_names: tuple[str, ...],
    cfg: Config,
    where: str,
) -> None:
    """Every class has MIN_PER_CLASS images at least in train, val and test, else one line
    naming the split, the classes and the fix: a split without a class silently measures
    fewer classes (and an empty val only fails later, in train, with no fix)."""
    for name, (src, idx) in splits.items():
        counts = np.bincount(src.labels[idx], minlength=len(class_names))
        short = [class_names[k] for k in np.flatnonzero(counts < MIN_PER_CLASS)]
        if not short:
            continue
        listed = ", ".join(short[:5]) + (f" and {len(short) - 5} more" if len(short) > 5 else "")
        carved = src is splits["train"][0]  # held out of train's images, not a folder of its own
        if carved and name == "val" and cfg.val_fraction == 0:
            fix = "set val_fraction above 0 (e.g. val_fraction=0.1)"
        elif carved:
            fix = (
                f"add images to {listed} in {where}: a class carved into train, val and test "
                f"needs {3 * MIN_PER_CLASS} at least"
            )
        else:
            fix = f"add images of {listed} to {name} in {where}"
        raise ShardError(
            f"{name} would hold fewer than {MIN_PER_CLASS} image(s) of class {listed} "
            f"({', '.join(f'{k} {len(v[1])}' for k, v in splits.items())} in all): {fix}"
        )


def run(cfg: Config) -> Path:
    real = cfg.root / "real"
    if already_complete(cfg, real):
        return real
    # 1. Load the source (may fail with a one-line message naming what is missing).
    source: Source = reader(cfg.source)(cfg)  # each preset says how its data are read
    where = str(source.origin or cfg.source)
    check_classes(source, where)
    splits = plan_splits(source, cfg)
    check_splits(splits, source.class_names, cfg, where)  # before anything is written
    write_config(real, cfg.recorded(), parts=SPLITS)  # an incomplete real/ defends nothing
    # a resumed root: its source must be the one its shards came from (a changed source under
    # a root that never completed: replaced, started again)
    if not check_source(real):
        write_config(real, cfg.recorded(), parts=SPLITS)
    pinned = record_source(real, source)
    log.info(
        "prepare %s: %d classes, %s -> %s",
        cfg.source,
        len(source.class_names),
        ", ".join(f"{k} {len(v[1])}" for k, v in splits.items()),
        real,
    )
    # 2. Write every split shard by shard, skipping complete shards (resume).
    size = cfg.image_size or source.splits["train"].get(0).shape[0]
    total, said = sum(len(idx) for _, idx in splits.values()), set()
    with progress(range(total), total=total, desc="prepare", unit="img") as bar:
        for name, (src, indices) in splits.items():
            folder = ShardFolder(real / name, prefix=name)
            chunks = [
                indices[i : i + cfg.shard_size] for i in range(0, len(indices), cfg.shard_size)
            ]
            for k, chunk in enumerate(chunks):
                if folder.done(k) is not None:
                    bar.update(len(chunk))
                    continue
                resize = cfg.resize if cfg.image_size > 0 else ""
                folder.write(k, _samples(name, src, chunk, size, resize, bar, said))
            # 3. Manifest last: the split is complete only now.
            folder.finish(
                len(chunks),
                kind="real",
                class_names=source.class_names,
                code_version=code_version(),
                info={"split": name, "source": cfg.source, "image_size": size, **pinned},
            )
    return real
