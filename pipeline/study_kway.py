"""`make study`'s k-way mixed sets (`csm3`): their own chain into <root>-k<k>/, sized to csm.

Split from `pipeline.study` (which plans and runs the study) so each reads top to bottom.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from models.simplex import num_lattice_points
from models.study_stats import bootstrap_difference
from pipeline.core.runtime import log
from shards.manifest import read_manifest

KWAY_LATTICE = 4  # m of the study's k-way sets: 15 images per 3-class series
KWAY_UPSTREAM = ("real", "generator", "train/encoder")  # what a k-way chain shares with csm's


def kway_root(root: Path, k: int) -> Path:
    """runs/<classes>-k<k>/: the k-way chain's own root (generate and annotate always write
    <root>/series and <root>/mixed, and the 2-way ones are csm's)."""
    return root.with_name(f"{root.name}-k{k}")


def link_complete(src: Path, dst: Path) -> None:
    """Share a complete upstream folder with another root: hard links (a copy across
    devices), built beside `dst` and renamed into place. Safe because semix never rewrites a
    file in place (temp + rename), and the downstream stages check its digests as usual."""
    if dst.exists() or not src.is_dir():
        return

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    tmp = dst.with_name(f".{dst.name}.linking")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, tmp, copy_function=link)
    os.replace(tmp, dst)


def prepare_kway(root: Path, k: int) -> list[str]:
    """Before the k-way chain: share csm's real/, generator/ and encoder run (no second
    prepare or fit), and size the k-way set to csm's number of generated images: lattice m =
    KWAY_LATTICE, `tuples` x `series_per_tuple` series, `tuples` the largest divisor of the
    series count that is at most C(n, k) so every tuple gets the same number of series."""
    for rel in KWAY_UPSTREAM:
        link_complete(root / rel, kway_root(root, k) / rel)
    mixed = read_manifest(root / "mixed")
    per_series = num_lattice_points(k, KWAY_LATTICE)
    series = max(1, round(mixed.num_samples / per_series))
    limit = min(series, math.comb(len(mixed.class_names), k))
    tuples = max(d for d in range(1, limit + 1) if series % d == 0)
    log.info(
        "study: k=%d set of %d series x %d images (csm: %d images), %d tuples",
        *(k, series, per_series, mixed.num_samples, tuples),
    )
    return [
        f"generate.mix_classes={k}",
        f"generate.lattice={KWAY_LATTICE}",
        f"generate.tuples={tuples}",
        f"generate.series_per_tuple={series // tuples}",
    ]


def kway_comparison(
    root: Path, methods: dict[str, int], preds: dict, n: int, rng: np.random.Generator
) -> dict[str, Any] | None:
    """csm<k> against 2-way csm (`methods`: study method -> k, the k-way ones): the bootstrap of
    the ECE difference, and the number of generated images each was given (they should match)."""
    if not methods:
        return None
    folders = [
        root / "mixed",
        *(kway_root(root, k) / "mixed" for k in sorted(set(methods.values()))),
    ]
    names = ["csm", *methods]
    result: dict[str, Any] = {
        "images": {f"{f.parent.name}/mixed": read_manifest(f).num_samples for f in folders}
    }
    for when, p in preds.items():
        result[when] = bootstrap_difference({m: p[m] for m in names}, "csm", n, rng)
    return result
