"""ood: far out-of-distribution test sets shaped like real/test -> runs/<classes>/ood/<set>/.

    python -m pipeline ood --preset fashion-mnist
    python -m pipeline evaluate --preset fashion-mnist --set ood=runs/fashion-mnist/ood/digits

Each set is a prepared split folder (the shard format of real/test: WebDataset shards of `png`
+ `cls`, `.done/` records, `manifest.json` last, kind `ood`), at real/test's image size, grey
when every real/test image is grey, so evaluate's `ood=` reads it as it reads real/test:

    digits     scikit-learn's 1,797 real 8x8 handwritten digits (the prepare stage's `digits`
               source), resized bicubic to the root's side; labels the digits 0..9. Far-OOD for
               every preset but digits (left out of the default on a digits root, refused when
               named there).
    uniform    i.i.d. pixel noise, U{0..255} per pixel (and channel for colour roots)
    gaussian   i.i.d. pixel noise, N(0.5, 0.25^2) on [0, 1], clipped, rounded to uint8

The synthetic sets hold `noise_images` images (default: as many as real/test); image i is drawn
from its own numpy generator seeded by (seed, "ood", set, i), so it never depends on the shard
size or the resume point. Reruns skip complete shards and complete sets; a complete set made
from another real/test is refused in one line (its manifest pins real/test's digest).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from core.config import ConfigError
from core.logs import log
from core.plots import image_grid
from core.seeding import derive_seed
from core.version import code_version
from shards.manifest import ShardError, is_complete, manifest_digest, read_manifest
from shards.reader import iter_folder
from shards.sources import digits_source
from shards.writer import ShardFolder, write_config
from stages.configs.ood import SETS, Config

OOD = "ood"
KIND = "ood"
PREVIEW = "preview.png"
PREVIEW_IMAGES = 16


def ood_dir(root: Path, name: str) -> Path:
    return Path(root) / OOD / name


def describe_split(folder: Path) -> tuple[int, int, bool]:
    """(images, side, grey) of a prepared split: grey = R = G = B in every image."""
    n, side, grey = 0, 0, True
    for sample in iter_folder(folder):
        image = sample["image"]
        n, side = n + 1, image.shape[0]
        grey = grey and bool((image[..., 0] == image[..., 1]).all())
        grey = grey and bool((image[..., 0] == image[..., 2]).all())
    if n == 0:
        raise ShardError(f"{folder} holds no samples")
    return n, side, grey


# ---------------------------------------------------------------- the sets
# Each: (side, grey, images wanted, seed) -> (class names, number of images, image i -> (uint8
# [side, side, 3], label)).

Images = tuple[tuple[str, ...], int, Callable[[int], tuple[np.ndarray, int]]]


def digits_set(side: int, grey: bool, count: int, seed: int) -> Images:
    """scikit-learn's digits (values 0..16 as 0..255 grey RGB), resized bicubic to side x side
    as the prepare stage squashes them."""
    source = digits_source()
    split = source.splits["train"]

    def image(i: int) -> tuple[np.ndarray, int]:
        im = Image.fromarray(split.get(i)).resize((side, side), Image.Resampling.BICUBIC)
        return np.asarray(im), int(split.labels[i])

    return source.class_names, len(split), image


def _noise_set(draw: Callable[[np.random.Generator, tuple[int, ...]], np.ndarray], name: str):
    def build(side: int, grey: bool, count: int, seed: int) -> Images:
        def image(i: int) -> tuple[np.ndarray, int]:
            rng = np.random.default_rng(derive_seed(seed, OOD, name, i))
            pixels = draw(rng, (side, side, 1 if grey else 3))
            return np.repeat(pixels, 3 // pixels.shape[-1], axis=-1), 0

        return ("noise",), count, image

    return build


def _uniform(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, 256, shape, dtype=np.uint8)


def _gaussian(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return np.round(np.clip(rng.normal(0.5, 0.25, shape), 0.0, 1.0) * 255.0).astype(np.uint8)


BUILDERS: dict[str, Callable[[int, bool, int, int], Images]] = {
    "digits": digits_set,
    "uniform": _noise_set(_uniform, "uniform"),
    "gaussian": _noise_set(_gaussian, "gaussian"),
}
SOURCES = {"digits": "digits", "uniform": "synthetic", "gaussian": "synthetic"}


# ---------------------------------------------------------------- writing


def _samples(
    name: str, image: Callable[[int], tuple[np.ndarray, int]], indices: range
) -> Iterator[dict]:
    for i in indices:
        pixels, label = image(i)
        yield {"__key__": f"{name}_{i:07d}", "png": pixels, "cls": label}


def set_config(cfg: Config, name: str) -> dict[str, Any]:
    """What a set's config.json holds: the stage's config for this one set (`sets`, not
    recorded, says which folders a call builds, not what one holds; noise_images only counts
    for noise)."""
    d = cfg.recorded()
    if SOURCES[name] != "synthetic":
        del d["noise_images"]
    return {**d, "set": name}


def _complete(folder: Path, config: dict[str, Any], upstream: dict[str, str]) -> bool:
    """A complete set of this config made from this real/test (skip); another real/test is
    refused in one line (a complete folder is never rewritten); incomplete: False."""
    if not is_complete(folder):
        return False
    write_config(folder, config)  # compares only: refuses another config
    if read_manifest(folder).upstream != upstream:
        raise ShardError(
            f"{folder} is complete but was made from another real/test (its manifest's digest "
            f"differs): remove the folder to rebuild it"
        )
    return True


def build_set(
    cfg: Config, name: str, split: Callable[[], tuple[int, int, bool]], upstream: dict
) -> Path:
    """One set's folder: config first, shards (complete ones skipped), preview, manifest last.
    `split()`: real/test's (images, side, grey), read only when a set is to be built."""
    folder = ood_dir(cfg.root, name)
    config = set_config(cfg, name)
    if _complete(folder, config, upstream):
        log.info("ood: %s is complete already", folder)
        return folder
    n_test, side, grey = split()
    write_config(folder, config)
    class_names, count, image = BUILDERS[name](side, grey, cfg.noise_images or n_test, cfg.seed)
    shards = ShardFolder(folder, prefix=name)
    chunks = [range(i, min(i + cfg.shard_size, count)) for i in range(0, count, cfg.shard_size)]
    for k, chunk in enumerate(chunks):
        if shards.done(k) is None:
            shards.write(k, _samples(name, image, chunk))
    tiles = np.stack([image(i)[0] for i in range(min(PREVIEW_IMAGES, count))])[None]
    image_grid(tiles, folder / PREVIEW, scale=max(1, 56 // side))
    shards.finish(
        len(chunks),
        kind=KIND,
        class_names=class_names,
        upstream=upstream,
        code_version=code_version(),
        info={"set": name, "source": SOURCES[name], "image_size": side, "grey": grey},
    )
    log.info("ood: %s: %d images (%dx%d%s) -> %s", name, count, side, side, " grey" * grey, folder)
    return folder


def run(cfg: Config) -> Path:
    # 1. real/test: complete (else one line naming prepare) and where it comes from.
    test = cfg.root / "real" / "test"
    upstream = {"real/test": manifest_digest(test)}
    source = read_manifest(test).info.get("source", "")
    # 2. Which sets: the named ones, or every set that is OOD for this root.
    if "digits" in cfg.sets and source == "digits":
        raise ConfigError(
            f"sets=digits: {test} is scikit-learn's digits itself, so the digits set is not "
            "out-of-distribution there; pick uniform and/or gaussian"
        )
    names = cfg.sets or tuple(s for s in SETS if not (s == "digits" and source == "digits"))
    # 3. Each set in its own folder, complete only once its manifest is written; real/test's
    # size and channels are read (once) only when a set is to be built.
    split = functools.cache(lambda: describe_split(test))
    for name in names:
        build_set(cfg, name, split, upstream)
    return cfg.root / OOD
