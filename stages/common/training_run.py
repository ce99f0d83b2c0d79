"""A run folder being trained: what `train` and `finetune` do around the loop, in one place.

    run = TrainingRun.open(cfg, "train", cfg.run, OTHER_RUN)   # accelerator + tracking
    if run.complete(made_from):                                 # a complete run only reads
        return run.folder
    run.check_resume()
    ... the stage's data, model, objective ...
    run.write_config()                                          # first file (main); all wait
    result = run.fit(run.recipe(key, lr, keep, "optim.lr"), module, optimizer, data, path, section)
    if run.main:
        metrics = run.final_metrics(result, path, section)      # host.json too
        write_run(run.folder, result.weights, meta, metrics, [run.curves(...), ...], made_from)
    return run.done()

Why one place: a train run and a fine-tuned run are the same kind of output (`<root>/<stage>/
<name>/`: config.json first, checkpoints, metrics.json and host.json rewritten every epoch, the
manifest last), so the rules that make a folder a run (a complete one only reads, one made
from other inputs is refused, a bad `resume=` fails before any work, the trackers close before
the outputs, the data path's workers are closed whatever happens) are written once. What a
stage trains (model, objective, optimizer, lr schedule, kept epoch) and what its model.json
and metrics.json say stay in the stage: each stage's `run` reads as its own steps. The stage
writes the run itself (`shards.runs.write_run`): the last step of its `run`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import Accelerator

from core.io import atomic_write_json
from core.logs import log
from core.plots import lines
from core.tracking import Tracking
from models.objectives import TrainingModule
from shards.datapath import DataPathChoice
from shards.runs import run_complete, write_host
from shards.writer import OTHER_ROOT, replaces, write_config
from stages.common import data as datapath
from stages.common.batches import Recipe, TrainingData
from stages.common.epochs import LoopState, Result, fit_epochs
from stages.common.loop import check_resume, drain, make_accelerator, run_precision
from stages.configs.sections import Augment, Checkpoint

# metrics.json's section of a run: (the loop's state, finished?) -> what the stage records
Section = Callable[[LoopState, bool], dict[str, Any]]


class RunConfig(Protocol):
    """What the run's machinery reads of train's and finetune's configs (fields or properties)."""

    root: Path  # runs/<classes>/
    tracker: str
    precision: str
    epochs: int
    batch_size: int
    optim: Any  # a section with clip_norm
    augment: Augment
    checkpoint: Checkpoint
    eval_batch_size: int

    def recorded(self) -> dict[str, Any]: ...  # config.json

    def to_dict(self) -> dict[str, Any]: ...  # what the trackers are given


@dataclass
class TrainingRun:
    """`<root>/<stage>/<name>/` of one train or finetune run, with its accelerator and trackers.

    `stage` names the folder's parent, metrics.json's section and the first word of every log
    line; `fix` is what a refused config.json tells the user to do."""

    cfg: RunConfig
    stage: str
    name: str
    fix: str
    folder: Path
    tracking: Tracking
    accelerator: Accelerator
    fresh: bool = False  # the folder is replaced (shards.writer.replaces): nothing to resume

    @classmethod
    def open(cls, cfg: RunConfig, stage: str, name: str, fix: str = OTHER_ROOT) -> TrainingRun:
        """The accelerator (DDP under a launcher, bf16 where the device computes it natively:
        stages.common.loop.make_accelerator)
        with the trackers of `tracker=`, whose files go outside the run's own."""
        folder = cfg.root / stage / name
        tracking = Tracking.of(cfg.tracker, folder, cfg.root)
        # a folder that never completed under another config (a diverged run rerun with a
        # smaller lr) is replaced by write_config: its checkpoints are not this run's to resume
        fresh = replaces(folder, cfg.recorded())
        resume = "" if fresh else cfg.checkpoint.resume
        precision = run_precision(folder, cfg.precision, resume)
        accelerator = make_accelerator(precision, **tracking.accelerator_kwargs())
        return cls(cfg, stage, name, fix, folder, tracking, accelerator, fresh)

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    # ------------------------------------------------------------ before any work

    def complete(self, made_from: Mapping[str, str]) -> bool:
        """True when the run is complete and made from these upstream digests: the rerun only
        reads (its config compared, never written). One made from other inputs, or under this
        name with another config, is refused in one line (shards.runs.run_complete)."""
        if not run_complete(self.folder, made_from):
            return False
        write_config(self.folder, self.cfg.recorded(), self.fix)  # refuses another config here
        log.info(
            "%s %s: already finished (%s is complete); nothing to do",
            *(self.stage, self.name, self.folder),
        )
        return True

    def check_resume(self) -> None:
        """A `resume=` that names no usable checkpoint fails now, before any data is read."""
        if not self.fresh:
            check_resume(self.folder, self.cfg.checkpoint.resume)

    def write_config(self) -> None:
        """config.json, the run's first file (main process; refuses another config under the
        name), once the inputs are known to be good; every process waits for it."""
        if self.main:
            write_config(self.folder, self.cfg.recorded(), self.fix)
        self.accelerator.wait_for_everyone()

    # ------------------------------------------------------------ the loop

    def recipe(
        self, key: tuple[Any, ...], lr: Callable[[int], float], keep: str, lr_field: str
    ) -> Recipe:
        """The loop's recipe: the stage gives its draws' key, its lr schedule, the epoch it
        keeps ("best" on val, or "last") and the field its lr comes from (what a diverged
        run's error names); the rest is the config's machinery."""
        cfg = self.cfg
        return Recipe(
            key=key,
            epochs=cfg.epochs,
            batch_size=cfg.batch_size,
            lr=lr,
            clip_norm=cfg.optim.clip_norm,  # the classifier only: a FeDLaS gate is left out (§5)
            crop_pad=cfg.augment.crop_pad,
            flip=cfg.augment.flip,
            keep=keep,
            eval_batch_size=cfg.eval_batch_size,
            checkpoint_limit=cfg.checkpoint.limit,
            resume=cfg.checkpoint.resume,
            lr_field=lr_field,
        )

    def fit(
        self,
        recipe: Recipe,
        module: TrainingModule,
        optimizer: torch.optim.Optimizer,
        data: TrainingData,
        path: DataPathChoice,
        section: Section,
        describe: Callable[[dict[str, Any]], str] = lambda stats: "",
    ) -> Result:
        """stages.common.epochs.fit_epochs to its end, with metrics.json and host.json rewritten
        after every epoch (main) and the trackers open around it; the data's pixel source and
        validation reader are closed, and the trackers finished, before anything else is
        written."""
        try:
            return drain(self.fit_epochs(recipe, module, optimizer, data, path, section, describe))
        finally:
            datapath.close(data.pixels, data.val)

    def fit_epochs(
        self,
        recipe: Recipe,
        module: TrainingModule,
        optimizer: torch.optim.Optimizer,
        data: TrainingData,
        path: DataPathChoice,
        section: Section,
        describe: Callable[[dict[str, Any]], str] = lambda stats: "",
    ) -> Generator[LoopState, None, Result]:
        """`fit` one epoch at a time (stages.common.epochs.fit_epochs), the data left open: the
        runs of a stack share it, and whoever opened it closes it."""

        def progress(state: LoopState) -> None:
            atomic_write_json(self.folder / "metrics.json", {self.stage: section(state, False)})
            write_host(self.folder, path.record(), state.history, accelerator.mixed_precision)

        name, accelerator = f"{self.stage} {self.name}", self.accelerator
        self.tracking.start(accelerator, self.cfg.to_dict())  # closed before the outputs
        try:
            return (
                yield from fit_epochs(
                    *(self.folder, recipe, module, optimizer, data, accelerator, name),
                    *(progress, describe),
                )
            )
        finally:
            self.tracking.finish(accelerator)

    # ------------------------------------------------------------ outputs (main process)

    def final_metrics(
        self, result: Result, path: DataPathChoice, section: Section
    ) -> dict[str, Any]:
        """metrics.json's final content (the finished section); host.json rewritten with the
        whole history (a rerun that resumed after the last epoch trained none)."""
        write_host(
            self.folder, path.record(), result.state.history, self.accelerator.mixed_precision
        )
        return {self.stage: section(result.state, True)}

    @staticmethod
    def curves(history: list[dict[str, Any]], title: str) -> Callable[[Path], None]:
        """curves.png: validation accuracy and ECE per epoch."""
        series = {
            "val acc (%)": [h["val_acc"] for h in history],
            "val ECE (%)": [h["val_ece"] for h in history],
        }

        def plot(folder: Path) -> None:
            lines(series, folder / "curves.png", xlabel="epoch", title=title)

        return plot

    def done(self) -> Path:
        """Every process leaves the stage together (the main one wrote the outputs)."""
        self.accelerator.wait_for_everyone()
        return self.folder
