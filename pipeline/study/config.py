"""What a study is made of: its config, its methods and its tasks.

Its own module so that the study's plan (pipeline.study.plan), its tuning grids
(pipeline.study.tuning) and its report (pipeline.study.report) all import it and not each other.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.config import ConfigError
from pipeline.study.protocol import COMMITTED, PROTOCOL


class StudyError(ValueError):
    """A study run failed: the CLI prints it as one line naming the run's log."""


@dataclass(frozen=True)
class Method:
    """How one study method is made: a train run with these overrides, or a fine-tuning of
    another method's run (`base`)."""

    stage: str  # train | finetune
    sets: tuple[str, ...]
    base: str = ""  # finetune: the method whose run is fine-tuned
    needs_mixed: bool = False
    # k of the mixed set it trains on; k >= 3: a second chain into <root>-k<k>/ (kway_chain)
    mix_classes: int = 2
    redraw: bool = False  # trains on fidelity-aware series: a chain into <root>-redraw/

    @property
    def variant(self) -> str:
        """The mixed set's chain: "" = csm's, "k<k>" or "redraw" = its own root."""
        return f"k{self.mix_classes}" if self.mix_classes > 2 else "redraw" if self.redraw else ""


METHODS: dict[str, Method] = {
    "ce": Method("train", ("loss=ce",)),
    "csm": Method("train", ("loss=csm",), needs_mixed=True),
    # the CSM paper's ablations: ratio labels t_a = α (no re-annotation); CE on the mixed images
    "csm-ratio": Method("train", ("loss=csm", "loss.csm.targets=ratio"), needs_mixed=True),
    "csm-ce": Method("train", ("loss=csm", "loss.csm.mixed_loss=ce"), needs_mixed=True),
    # beyond the paper: series mixing 3 classes (simplex lattice m = 4), as many images as csm
    "csm3": Method("train", ("loss=csm",), needs_mixed=True, mix_classes=3),
    # beyond the paper: series whose pure images the encoder rejects are redrawn (docs/generate.md)
    "csm-redraw": Method("train", ("loss=csm",), needs_mixed=True, redraw=True),
    "ls": Method("train", ("loss=ls",)),
    "focal": Method("train", ("loss=focal",)),
    "mixup": Method("train", ("loss=mixup",)),
    "mmce": Method("train", ("loss=mmce",)),
    "fedlas-ls": Method("train", ("loss=fedlas-ls",)),
    # finetune's `objective=` was `method=`: the same config.json (its key `method`), the same
    # task names; only the word the task's command line types changed
    "ce+maccal": Method("finetune", ("objective=maccal",), base="ce"),
    "csm+maccal": Method("finetune", ("objective=maccal",), base="csm", needs_mixed=True),
}
# the order runs start in: the comparison that matters most first
DEFAULT_METHODS = (
    "ce", "csm", "csm-redraw", "csm3", "ls", "focal", "mixup", "fedlas-ls", "ce+maccal",
    "csm+maccal", "csm-ratio", "csm-ce",
)  # fmt: skip
# the methods of the primary endpoints (csm vs ce; csm + TS vs ce + TS; csm3 vs csm): ce and csm
# run every seed of StudyConfig.seeds, the others of PRIMARY_METHODS its first `primary_seeds`
PRIMARY_METHODS = ("ce", "csm", "csm3")
EVERY_SEED = ("ce", "csm")
# the methods the verdict compares (docs/study.md); those outside PRIMARY_METHODS are exploratory
VERDICT_METHODS = ("ce", "csm", "csm3", "csm-redraw", "ce+maccal", "csm+maccal")
# the comparisons the verdict reads, beside every method against ce: (method, reference)
VERDICT_PAIRS = (("csm3", "csm"), ("csm-redraw", "csm"), ("csm+maccal", "ce+maccal"))
# the baseline "ce + the best post-hoc calibrator on val" (models/posthoc.py), a pseudo-method of
# the paired comparisons after TS (its probabilities are in ce's predictions.npz)
POSTHOC = "ce+posthoc"
METRICS = ("top1", "ece", "aece", "classwise_ece", "oece", "uece", "mce", "nll", "brier")


MAX_FITS = 100  # fit f's fit-generator seed is the chain's + f; the cell fit's + CELL_FIT_SEED
CELL_FIT_SEED = 1000


@dataclass(frozen=True)
class StudyConfig:
    methods: tuple[str, ...] = DEFAULT_METHODS
    # ce and csm run every seed, the primary endpoints' other methods (csm3) the first
    # `primary_seeds`, the exploratory ones (every other method) the first `other_seeds` (seed k
    # of two methods share their initialisation: the statistics pair them)
    # (the protocol's seeds, docs/protocol.toml)
    seeds: tuple[int, ...] = PROTOCOL.seeds
    primary_seeds: int = PROTOCOL.primary_seeds
    other_seeds: int = PROTOCOL.other_seeds
    # independent generator fits (fit f: fit-generator's seed + f, its own chain root; records'
    # `fit`), each with `mixed_sets` independent mixed sets of each csm-family chain (csm's,
    # csm3's, csm-redraw's), each drawn with its own generate seed: the run of the i-th seed
    # trains on fit i mod fits, set (i div fits) mod mixed_sets (`fit_of`, `mixed_set`), so the
    # variance of fitting a generator, and of drawing from it, is in the comparisons (the
    # protocol's fits and mixed sets per fit)
    fits: int = PROTOCOL.fits
    mixed_sets: int = PROTOCOL.mixed_sets_per_fit
    jobs: int = 2  # runs at a time (subprocesses)
    # a train method's seeds that share a mixed set train as one stack (train seeds=...): one
    # process, the data read once, each run its own folder as when trained alone; off: a
    # process per seed
    stack: bool = True
    bootstrap: int = 2000  # resamples for the 95 % intervals
    ts_criterion: str = "nll"  # evaluate's temperature-scaling criterion
    # every method's own hyper-parameters chosen on val, each from a grid of the same size
    # (pipeline/study/tuning.py GRIDS: a run per point and tuning seed, one more point per edge
    # choice); off: the presets'
    tune: bool = True
    # the seeds every grid point runs at (100, 101, ...): its score is the mean val NLL over
    # them, and a winner whose advantage over the reference point is within one standard error
    # of their paired differences gives way to the reference (pipeline/study/tuning.py choose_point)
    tune_seeds: int = PROTOCOL.tune_seeds
    # the generator's sampler cell (guidance w, x̂₀ clipping) tuned like csm's other
    # hyper-parameters: csm at its reference point on each cell the fit judged faithful, the
    # lowest val NLL by the same rule (pipeline/study/cells.py); off, or without `tune`: the
    # fit's most faithful cell
    cells: bool = True
    # every run also evaluated under shift (the corrupted test split) and on far-OOD sets, the
    # comparisons paired as in the main table (pipeline/study/robustness_stats.py); off: the clean test only
    robustness: bool = True
    # the protocol the study is run under (relative: from the repository root): its sha256 goes
    # to study.json and, at the start, study/protocol.lock; the study's values are the committed
    # file's, so another file must hold the same values (pipeline/study/protocol.py)
    protocol: str = COMMITTED

    def __post_init__(self):
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ConfigError(
                f"unknown study method(s) {unknown}; choose from: {', '.join(METHODS)}"
            )
        if "ce" not in self.methods:
            raise ConfigError("study.methods must include ce: every method is compared with it")
        for m in self.methods:
            base = METHODS[m].base
            if base and base not in self.methods:
                raise ConfigError(f"study method {m} fine-tunes {base}: add {base} to methods")
            if METHODS[m].variant and "csm" not in self.methods:
                raise ConfigError(f"study method {m} is compared with 2-way csm: add csm")
        counts = (self.primary_seeds, self.other_seeds, self.fits, self.mixed_sets, self.jobs)
        if not self.seeds or min(counts) < 1 or self.bootstrap < 100 or self.tune_seeds < 2:
            raise ConfigError(
                "study needs >= 1 seed, primary_seeds >= 1, other_seeds >= 1, fits >= 1, "
                "mixed_sets >= 1, jobs >= 1, bootstrap >= 100 and tune_seeds >= 2 (a standard "
                "error needs two)"
            )
        if self.fits > MAX_FITS:
            raise ConfigError(f"study.fits={self.fits}: at most {MAX_FITS} (fit seeds + f)")

    def seeds_of(self, method: str) -> tuple[int, ...]:
        """Every seed for ce and csm, the first `primary_seeds` for the primary endpoints' other
        methods, the first `other_seeds` for the exploratory ones."""
        if method in EVERY_SEED:
            return self.seeds
        if method in PRIMARY_METHODS:
            return self.seeds[: self.primary_seeds]
        return self.seeds[: self.other_seeds]

    def fit_of(self, method: str, seed: int) -> int | None:
        """The generator fit whose mixed set a run trains on (a fine-tuning: its source run's):
        round robin over the fits in seed order; None without a mixed set."""
        if not METHODS[method].needs_mixed:
            return None
        return self.seeds.index(seed) % self.fits

    def mixed_set(self, method: str, seed: int) -> int | None:
        """The mixed set of its fit (fit_of) a run trains on: round robin over a fit's sets once
        every fit has one; None without one."""
        if not METHODS[method].needs_mixed:
            return None
        return self.seeds.index(seed) // self.fits % self.mixed_sets


def run_name(method: str, seed: int) -> str:
    """The run folder: <loss>-s<seed> for train, <base>-s<seed>-maccal for fine-tuning (the
    finetune stage appends its method), so evaluate's report groups seeds the same way."""
    m = METHODS[method]
    return f"{m.base}-s{seed}-maccal" if m.stage == "finetune" else f"{method}-s{seed}"


@dataclass
class Task:
    name: str
    steps: list[tuple[str, list[str]]]  # (stage or command, --set values), run in order
    after: set[str] = field(default_factory=set)
    done: bool = False
    # run in this process before the commands; returns extra --set values for step `extra_step`
    # (the last one by default), or None: nothing to run (a tuning grid's extension that its
    # grid's choice does not need), the task is done as it is
    prepare: Callable[[], list[str] | None] | None = None
    extra_step: int = -1
    # the cores its commands keep busy at once: its stages' cpu_threads, the most of its steps
    # (a stage at torch's default, 0, and a chain's generate, one process per core: every core;
    # plan.task_cores). execute starts it only where that many are free (schedule.startable)
    cores: int = 1

    def commands(self, preset: str, extra: Sequence[str] = ()) -> list[list[str]]:
        at = self.extra_step % len(self.steps)
        return [
            [sys.executable, "-m", "pipeline", stage, "--preset", preset, "--set", *sets]
            + (list(extra) if i == at else [])
            for i, (stage, sets) in enumerate(self.steps)
        ]


def cpu_count() -> int:
    """The cores this process may run on (its affinity where the system says, as the chain's
    process count does), at least 1: the machine the study's tasks share."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


# the tuned baselines csm must also meet (on the seeds they share with it)
BASELINES = ("ls", "focal", "mixup", "mmce", "fedlas-ls")


def comparison_pairs(methods: Sequence[str]) -> list[tuple[str, str]]:
    """Every method against ce, the VERDICT_PAIRS, then csm against every tuned baseline, each
    pair whose two methods are in the study."""
    pairs = [(m, "ce") for m in methods if m != "ce"]
    more = [*VERDICT_PAIRS, *(("csm", b) for b in BASELINES)]
    return pairs + [(m, ref) for m, ref in more if m in methods and ref in methods]


def check_budget(records: list[dict[str, Any]]) -> int:
    """One labelled budget per comparison: every run must have been shaped by the same number
    of labelled training images (stages/common/budget.py), else the study refuses to compare, in one
    line naming each budget's methods."""
    unknown = sorted({r["method"] for r in records if r["labelled_train_images"] is None})
    if unknown:
        raise StudyError(
            f"the labelled budget of {', '.join(unknown)} is unknown (its runs were made before "
            "runs recorded it, or a part of them does not record what it read, e.g. a mixed set "
            "pulled from the Hub): a study compares only runs whose budgets it can count"
        )
    by_budget: dict[int, list[str]] = {}
    for r in records:
        methods = by_budget.setdefault(r["labelled_train_images"], [])
        if r["method"] not in methods:
            methods.append(r["method"])
    if len(by_budget) > 1:
        parts = "; ".join(f"{n} images: {', '.join(m)}" for n, m in sorted(by_budget.items()))
        raise StudyError(
            f"the methods saw different labelled budgets ({parts}); give every run, and every "
            "part it is made from (generator, its guidance judge, encoder, prototypes), the "
            "same train_limit"
        )
    return next(iter(by_budget))
