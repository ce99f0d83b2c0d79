"""The one training loop (`train_units`; not a stage: train, finetune and fit-generator call it).

    for unit in train_units(units, accelerator, run_dir, keep, resume): ...

The loop resumes a run from its newest complete checkpoint (shards/checkpoints.py), then trains
its units, each followed by a checkpoint. A run says what a unit is (`Units`): the classifier's
is an epoch (stages/common/epochs.py, with validation and the kept weights), fit-generator's a
block of optimizer steps (stages/fit_generator/training.py). Beside it, what every run on it
shares: the accelerator (`make_accelerator`: DDP under torchrun / accelerate launch, bf16 where
the device computes it natively; `accelerate_precision` says which) and the precision a resumed
run keeps (`run_precision`).
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import Accelerator
from torch import Tensor

from core.accelerator import new_accelerator
from core.io import read_json
from core.launch import share_from_main
from core.precision import ACCELERATE, canonical, resolve_precision
from shards.checkpoints import LOAD_KWARGS, MARKER, Checkpointer, checkpoint_number
from stages.common import phases

PRECISION_KEY = "precision"  # a checkpoint's record of the precision its run computes in


def accelerate_precision(precision: str, cpu: bool) -> str:
    """accelerate's mixed precision ("no", "bf16", "fp16") for precision=`precision` on the CPU
    (`cpu`) or a GPU: auto is bf16 autocast where the device computes bf16 natively (a bf16 GPU;
    a CPU with AVX512-BF16 or AMX, where the classifier step measured 1.4x faster and
    fit-generator's 1.3x: bench/RESULTS.md), else fp32; under `accelerate launch`, auto follows
    accelerate's mixed precision (core/precision.py)."""
    device = torch.device("cpu" if cpu else "cuda")
    return ACCELERATE[resolve_precision("precision", precision, device, cpu_bf16=True)]


def make_accelerator(precision: str, *, cpu: bool | None = None, **kwargs: Any) -> Accelerator:
    """DDP under a launcher, in `accelerate_precision(precision, cpu)`. `cpu`: None is the CPU
    where there is no CUDA (so that torchrun ranks on a CPU machine use gloo). `kwargs`: the
    Accelerator's other arguments, the trackers' (core.tracking.Tracking.accelerator_kwargs)
    among them."""
    if cpu is None:
        cpu = not torch.cuda.is_available()
    return new_accelerator(cpu=cpu, mixed_precision=accelerate_precision(precision, cpu), **kwargs)


def run_precision(run_dir: Path, precision: str, resume: str) -> str:
    """The precision a run computes in, fixed when it starts: `precision`, except that an `auto`
    run resumed keeps the one its checkpoint was computed in (`auto` can resolve to another
    precision on another machine)."""
    if canonical(precision) != "auto" or resume == "":
        return precision
    chosen = Checkpointer(run_dir / "checkpoints", keep=1).choose(resume, verify=False)
    if chosen is None:
        return precision
    saved = read_json(chosen / MARKER)
    # a checkpoint without the record: fp32 on a CPU
    cpu = not torch.cuda.is_available()
    return saved.get(PRECISION_KEY, "fp32" if cpu else precision)


def check_resume(run_dir: Path, resume: str) -> None:
    """A `resume=` that names no usable checkpoint fails now, in one line, before any work
    (the form and the completion marker; `train_units` verifies the files when it loads)."""
    Checkpointer(run_dir / "checkpoints", keep=1).choose(resume, verify=False)


class Units(Protocol):
    """A run's training cut into units, each ended by a checkpoint: the classifier's epochs
    (stages/common/epochs.py), fit-generator's blocks of optimizer steps
    (stages/fit_generator/training.py). `train_units` drives it; the run holds its own state
    (model, optimizer, counters)."""

    count: int  # units in the whole run
    files: tuple[str, ...]  # the run's own safetensors files in a checkpoint

    def restore(self, path: Path, saved: dict[str, Any], tensors: dict[str, Any]) -> int:
        """Take up the state of checkpoint `path` (accelerate's part is loaded already): the
        marker's JSON `saved` and the run's own `tensors` files. Returns the units done."""

    def bar(self, done: int) -> Any:
        """The progress bar of the units from `done` on (core.logs.progress)."""

    def train(self, unit: int, bar: Any) -> None:
        """Train unit `unit` (counted from 0)."""

    def checkpoint(self, unit: int) -> tuple[int, dict[str, Any], dict[str, dict[str, Tensor]]]:
        """The checkpoint after `unit`: (its number, the marker's JSON state, {file: tensors})."""

    def report(self, unit: int) -> None:
        """After the unit's checkpoint: what it tells the logs, the trackers and the files."""


def train_units(
    units: Units, accelerator: Accelerator, run_dir: Path, keep: int, resume: str
) -> Generator[int, None, None]:
    """The one training loop: resume from run_dir/checkpoints (the newest complete checkpoint,
    or the one `resume` names; the later ones are replayed), then train the units left, each
    followed by its checkpoint (the newest `keep` are kept); yields each unit once done."""
    ckpt = Checkpointer(
        run_dir / "checkpoints",
        keep=keep,
        files=units.files,
        is_main=accelerator.is_main_process,
        barrier=accelerator.wait_for_everyone,
        share=share_from_main(accelerator),
        ranks=accelerator.num_processes,
    )
    checkpoint, done = ckpt.choose(resume), 0
    if checkpoint is not None:
        saved, tensors = ckpt.load(
            checkpoint, lambda p: accelerator.load_state(str(p), load_kwargs=LOAD_KWARGS)
        )
        done = units.restore(checkpoint, saved, tensors)
    ckpt.tidy(first_free=checkpoint_number(checkpoint) + 1 if checkpoint is not None else 0)
    with units.bar(done) as bar:
        for unit in range(done, units.count):
            units.train(unit, bar)
            with phases.phase("checkpoint"):
                number, state, tensors = units.checkpoint(unit)
                ckpt.save(
                    number, lambda folder: accelerator.save_state(str(folder)), state, tensors
                )
            with phases.phase("report"):
                units.report(unit)
            yield unit


def drain(run: Generator[Any, None, Any]) -> Any:
    """Run a generator (`fit_epochs`, `train_units`) to its end; what it returns."""
    while True:
        try:
            next(run)
        except StopIteration as stop:
            return stop.value
