"""`make study`'s other mixed sets, each its own chain into <root>-<variant>/ sharing csm's real/,
generator/ and classifier runs: k-way sets (`csm3`: <root>-k3/, sized to csm) and fidelity-aware
series (`csm-redraw`: <root>-redraw/, generate's endpoint.check=redraw).
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from core.logs import log
from models.simplex import num_lattice_points
from shards.manifest import read_manifest

KWAY_LATTICE = 4  # m of the study's k-way sets: 15 images per 3-class series
# what a variant chain shares with csm's: every run its chain trains before generate (the
# encoder, and the report-only fidelity judges of the chains that have them), so a variant
# chain trains nothing again
KWAY_UPSTREAM = ("real", "generator", "train/encoder", "train/judge", "train/judge-noflip")
# what a generator fit's root shares with csm's before its own fit: everything but the generator
FIT_UPSTREAM = tuple(rel for rel in KWAY_UPSTREAM if rel != "generator")


def variant_root(root: Path, variant: str) -> Path:
    """runs/<classes>-<variant>/: a variant chain's own root (generate and annotate always write
    <root>/series and <root>/mixed, and those of <root> are csm's)."""
    return root.with_name(f"{root.name}-{variant}")


def set_variant(variant: str, index: int, fit: int = 0) -> str:
    """The variant root of a method family's mixed set `index` of generator fit `fit`
    (StudyConfig.fits, mixed_sets): fit 0's set 0 is the family's own ("" = csm's <root>,
    "k3", "redraw"), its set j > 0 "m<j>", "k3-m<j>", ...; fit f > 0 adds "f<f>": csm's set 0
    of fit f is the fit's own root, <root>-f<f> ("f<f>"), then "f<f>-m<j>", "k3-f<f>", ..."""
    parts = [variant, f"f{fit}" if fit else "", f"m{index}" if index else ""]
    return "-".join(p for p in parts if p)


def fit_variant(fit: int) -> str:
    """The chain root of generator fit `fit`: "" (<root>) for fit 0, "f<f>" after it."""
    return set_variant("", 0, fit)


def chain_task(variant: str) -> str:
    """The study task that makes a variant root's mixed set: chain, chain-k3, chain-m1, ..."""
    return f"chain-{variant}" if variant else "chain"


def prepare_set(
    root: Path,
    variant: str,
    index: int,
    generate_seed: int,
    fit: int = 0,
    sets_per_fit: int = 1,
    fit_sets: Sequence[str] = (),
) -> list[str]:
    """Before the chain of mixed set `index` of generator fit `fit` of a family: share the
    fit's upstream folders (its generator, csm's real/ and runs; and the family's own settings:
    prepare_kway, prepare_redraw), and draw its series with their own generate seed (the
    chain's + fit x sets_per_fit + index), so each set is an independent draw of its fit's
    generator; `fit_sets`: the fit's chain-scope settings (its fit-generator seed)."""
    dst = variant_root(root, set_variant(variant, index, fit))
    source = variant_root(root, fit_variant(fit)) if fit else root
    if variant == "redraw":
        sets = prepare_redraw(root, dst, source)
    elif variant:
        sets = prepare_kway(root, int(variant[1:]), dst, source)
    else:
        share_upstream(source, dst)
        sets = []
    draw = fit * sets_per_fit + index
    return [*fit_sets, *sets, *([f"generate.seed={generate_seed + draw}"] if draw else [])]


def share_upstream(root: Path, dst: Path) -> None:
    """csm's complete upstream folders (KWAY_UPSTREAM) in another root, by link."""
    for rel in KWAY_UPSTREAM:
        link_complete(root / rel, dst / rel)


def kway_root(root: Path, k: int) -> Path:
    """runs/<classes>-k<k>/: the k-way chain's root."""
    return variant_root(root, f"k{k}")


def prepare_redraw(root: Path, dst: Path | None = None, source: Path | None = None) -> list[str]:
    """Before the redraw chain (into `dst`, default <root>-redraw): share the upstream folders
    of `source` (default csm's root); the same plan as csm's, every series whose pure images the
    encoder rejects redrawn (docs/generate.md)."""
    share_upstream(source or root, dst or variant_root(root, "redraw"))
    return ["generate.endpoint.check=redraw"]


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


def prepare_kway(
    root: Path, k: int, dst: Path | None = None, source: Path | None = None
) -> list[str]:
    """Before the k-way chain (into `dst`, default <root>-k<k>): share csm's real/, generator/ and encoder run (no second
    prepare or fit), and size the k-way set to csm's number of generated images: lattice m =
    KWAY_LATTICE, `tuples` x `series_per_tuple` series, `tuples` the largest divisor of the
    series count that is at most C(n, k) so every tuple gets the same number of series."""
    share_upstream(source or root, dst or kway_root(root, k))  # source: a fit's root
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
        f"generate.mixing.mix_classes={k}",
        f"generate.mixing.lattice={KWAY_LATTICE}",
        f"generate.mixing.tuples={tuples}",
        f"generate.mixing.series_per_tuple={series // tuples}",
    ]


def mixed_images(root: Path, variants: Sequence[str]) -> dict[str, int]:
    """{"<root>/mixed": generated images, "<root>-<variant>/mixed": ...}: what csm and each other
    mixed set's method were given (the paired comparisons against csm are in study.json's
    `paired`)."""
    folders = [root / "mixed", *(variant_root(root, v) / "mixed" for v in variants)]
    return {f"{f.parent.name}/mixed": read_manifest(f).num_samples for f in folders}
