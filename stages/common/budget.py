"""The labelled budget: how many labelled training images shaped an output.

A fair comparison gives every method the same labelled images, and counts what shaped a method
through its parts: a csm run learns from its own real images, from the generator that drew its
series (and the judge that chose the generator's guidance, fit-generator's `fidelity.judge`, and
the one that chose which series to redraw: generate's `endpoint.judge`), and from the encoder and
prototypes that annotated them; a fine-tuned run from the run it started from. A judge that only
reports (fit-generator's `fidelity.report_judges`, annotate's `judge`) chooses nothing and counts
for nothing.

The val split is labelled too: every run chooses its checkpoint on all of real/val, and a study
its hyper-parameters, temperatures and calibrators, the same images for every method.
`labelled_split_images` states both, {"train": N, "val": M}.

Every stage that reads labelled images reads a *prefix* of real/train: the first ``train_limit``
images in their stored order (0 = all). So the distinct labelled images behind an output made of
several parts is the largest prefix any of its parts read, which is what `labelled_images`
returns. It reads only what the folders record (manifest.json, and config.json as the stage's
typed config: core.codec.load), so it is the same number on any machine, and it needs no file
of its own in generator/ or mixed/. It sits with the stages because it reads their configs.

Parts trained elsewhere (a pretrained diffusion model, OpenCLIP) saw no image of this dataset's
training split that semix can count: they add nothing to the count. A part that does not
record what it read (a mixed set pulled from the Hub, a folder made by hand)
makes the count unknown: None, which no study compares.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from core.codec import CONFIG_JSON, load
from shards.manifest import MANIFEST, ShardError, is_complete, read_manifest
from stages.configs.annotate import Config as AnnotateConfig
from stages.configs.finetune import Config as FinetuneConfig
from stages.configs.fit_generator import Config as FitGeneratorConfig
from stages.configs.generate import Config as GenerateConfig
from stages.configs.train import Config as TrainConfig

PRETRAINED_BACKENDS = ("sd", "dit", "edm")  # generators fitted outside semix


class _Unknown(Exception):
    """A part does not record what it read (no config.json): the count is unknown."""


C = TypeVar("C")


def _recorded(folder: Path) -> None:
    """A part that records no config.json: the count is unknown."""
    if not (folder / CONFIG_JSON).is_file():
        raise _Unknown(folder)


def _config(config_cls: type[C], folder: Path) -> C:
    """`folder`'s recorded config, typed (`_Unknown` when it records none)."""
    _recorded(folder)
    return load(config_cls, folder)


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
    if stage == "finetune":  # the source run's images, and no others (finetune inherits them)
        return _run(root, "train", _config(FinetuneConfig, folder).run, seen)
    _recorded(folder)
    if not is_complete(folder):
        raise ShardError(f"{folder}: not a complete run (no {MANIFEST}); finish it first")
    cfg = _config(TrainConfig, folder)
    reads_mixed = "mixed" in read_manifest(folder).upstream
    mixed = Path(cfg.mixed) if cfg.mixed else root / "mixed"
    return _train(root, cfg.train_limit, mixed if reads_mixed else None, seen)


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
    cfg = _config(FitGeneratorConfig, folder)
    n = prefix(root, cfg.train_limit)
    if cfg.fidelity.judge:
        n = max(n, _run(root, "train", cfg.fidelity.judge, seen))
    return n


def _series(folder: Path, seen: set[Path]) -> int:
    """The generator, and the judge that chose which series to keep (generate's endpoint.judge,
    recorded only while its endpoint.check is on: otherwise it chooses nothing)."""
    cfg = _config(GenerateConfig, folder)
    root = folder.parent
    n = 0
    if cfg.endpoint.check != "off" and cfg.endpoint.judge:
        n = _run(root, "train", cfg.endpoint.judge, seen)
    if cfg.backend.name in PRETRAINED_BACKENDS:
        return n  # the generator was trained elsewhere: no image of this real/train
    return max(n, _generator(Path(cfg.model) if cfg.model else root / "generator", seen))


def _mixed(folder: Path, seen: set[Path]) -> int:
    """The series' generator, the annotation encoder (a classifier run) and the prototypes."""
    root = folder.parent
    cfg = _config(AnnotateConfig, folder)
    n = _series(Path(cfg.series) if cfg.series else root / "series", seen)
    if cfg.encoder.name == "classifier":
        n = max(n, _run(root, "train", cfg.encoder.classifier.run, seen))
    if cfg.prototypes == "real":
        n = max(n, prefix(root, cfg.train_limit))
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
