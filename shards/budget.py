"""The labelled budget: how many labelled training images shaped an output.

A fair comparison gives every method the same labelled images, and counts what shaped a method
through its parts: a csm run learns from its own real images, from the generator that drew its
series (and the judge that chose the generator's guidance, and the one that chose which series
to redraw: generate's endpoint_judge), and from the encoder and prototypes that annotated them; a
fine-tuned run from the run it started from. A judge that only reports (fit-generator's
report_judges, annotate's fidelity_run) chooses nothing and counts for nothing.

The val split is labelled too: every run chooses its checkpoint on all of real/val, and a study
its hyper-parameters, temperatures and calibrators, the same images for every method.
`labelled_split_images` states both, {"train": N, "val": M}.

Every stage that reads labelled images reads a *prefix* of real/train: the first ``train_limit``
images in their stored order (0 = all). So the distinct labelled images behind an output made of
several parts is the largest prefix any of its parts read, which is what `labelled_images`
returns. It reads only what the folders record (config.json, manifest.json), so it is the same
number on any machine, and it needs no file of its own in generator/ or mixed/.

Parts trained elsewhere (a pretrained diffusion model, OpenCLIP) saw no image of this dataset's
training split that semix can count: they add nothing to the count. A part that does not
record what it read (a mixed set pulled from the Hub, a folder made by hand)
makes the count unknown: None, which no study compares.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.io import read_json
from shards.manifest import MANIFEST, ShardError, is_complete, read_manifest

PRETRAINED_BACKENDS = ("sd", "dit", "edm")  # generators fitted outside semix


class _Unknown(Exception):
    """A part does not record what it read (no config.json): the count is unknown."""


def _config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise _Unknown(folder)
    return read_json(path)


def train_size(root: Path) -> int:
    """The images in real/train (its manifest's sample count)."""
    return read_manifest(root / "real" / "train").num_samples


def prefix(root: Path, limit: int) -> int:
    """The images a ``train_limit`` reads: the first ``limit`` (0 = all of real/train)."""
    n = train_size(root)
    return min(int(limit), n) if limit else n


def _run(root: Path, stage: str, name: str, seen: set[Path]) -> int:
    folder = root / stage / name
    if folder in seen:  # a cycle cannot happen on disk, but a damaged config must not loop
        raise ShardError(f"{folder}: its config names itself through its parts")
    seen = seen | {folder}
    cfg = _config(folder)
    if stage == "finetune":  # the source run's images, and no others (finetune inherits them)
        return _run(root, "train", cfg["run"], seen)
    if not is_complete(folder):
        raise ShardError(f"{folder}: not a complete run (no {MANIFEST}); finish it first")
    reads_mixed = "mixed" in read_manifest(folder).upstream
    mixed = Path(cfg["mixed"]) if cfg.get("mixed") else root / "mixed"
    return _train(root, cfg.get("train_limit", 0), mixed if reads_mixed else None, seen)


def _train(root: Path, train_limit: int, mixed: Path | None, seen: set[Path]) -> int:
    n = prefix(root, train_limit)
    return max(n, _mixed(mixed, seen)) if mixed is not None else n


def train_run_images(root: Path, train_limit: int, mixed: Path | None = None) -> int | None:
    """The budget of a train run being made: its own ``train_limit`` images and, when it reads a
    mixed set, everything behind that set (None: unknown)."""
    try:
        return _train(root, train_limit, mixed, set())
    except _Unknown:
        return None


def _generator(folder: Path, seen: set[Path]) -> int:
    """fit-generator's own prefix, and the run that chose its guidance (the chooser shapes it;
    without one, the linear probe on the same prefix chose)."""
    root = folder.parent
    cfg = _config(folder)
    n = prefix(root, cfg.get("train_limit", 0))
    if cfg.get("judge_run"):
        n = max(n, _run(root, "train", cfg["judge_run"], seen))
    return n


def _series(folder: Path, seen: set[Path]) -> int:
    """The generator, and the judge that chose which series to keep (generate's endpoint_judge,
    recorded only while its endpoint_check is on: otherwise it chooses nothing)."""
    cfg = _config(folder)
    root = folder.parent
    n = 0
    if cfg.get("endpoint_check", "off") != "off" and cfg.get("endpoint_judge"):
        n = _run(root, "train", cfg["endpoint_judge"], seen)
    if cfg.get("backend", "unet") in PRETRAINED_BACKENDS:
        return n  # the generator was trained elsewhere: no image of this real/train
    return max(n, _generator(Path(cfg["model"]) if cfg.get("model") else root / "generator", seen))


def _mixed(folder: Path, seen: set[Path]) -> int:
    """The series' generator, the annotation encoder (a classifier run) and the prototypes."""
    root = folder.parent
    cfg = _config(folder)
    n = _series(Path(cfg["series"]) if cfg.get("series") else root / "series", seen)
    if cfg.get("encoder") == "classifier":
        n = max(n, _run(root, "train", cfg.get("encoder_run", "encoder"), seen))
    if cfg.get("prototypes", "real") == "real":
        n = max(n, prefix(root, cfg.get("train_limit", 0)))
    return n


def labelled_images(root: Path, stage: str, name: str = "") -> int | None:
    """The distinct labelled real/train images behind ``root/<stage>/<name>`` (train and
    finetune runs) or ``root/<stage>`` (generator, series, mixed); None when a part does not
    record what it read."""
    count = {"generator": _generator, "series": _series, "mixed": _mixed}
    if stage not in ("train", "finetune", *count):
        raise ValueError(f"labelled_images: no budget rule for stage {stage!r}")
    try:
        if stage in ("train", "finetune"):
            return _run(root, stage, name, set())
        return count[stage](root / stage, set())
    except _Unknown:
        return None


def val_size(root: Path) -> int:
    """The images in real/val (its manifest's sample count)."""
    return read_manifest(root / "real" / "val").num_samples


def labelled_split_images(root: Path, train: int | None) -> dict[str, int] | None:
    """{"train": N, "val": M}: the labelled images behind a study run, `train` as counted above
    (recorded by the run) and every image of real/val, which chose its checkpoint (and, in a
    study, its hyper-parameters, temperature and calibrator); None when `train` is unknown."""
    return None if train is None else {"train": train, "val": val_size(root)}
