"""train: real/ (+ mixed/ for loss=csm) -> runs/<classes>/train/<run>/.

    python -m pipeline train --preset digits --set run=ce loss=ce
    accelerate launch -m pipeline train --preset cifar100 --set run=csm loss=csm
    torchrun --nproc_per_node 2 -m pipeline train ...       (CPU, gloo)

A fresh classifier (init from (seed, "init")) and the objective of `loss=` go through the one
training loop (stages/common/epochs.py): SGD with a multistep lr, a checkpoint after each epoch, resume
from the newest complete one (bit for bit on CPU), the weights of the best validation epoch
kept. The images are decoded into device memory, or streamed from the shards when they would
not fit (`data_path=`, stages/common/data.py): the same steps and the same weights either way.

Run folder: config.json (first), checkpoints/checkpoint_<n>/ (after epoch n, counted from 1),
metrics.json (per-epoch history, rewritten each epoch) and host.json (this machine's data path
and seconds per epoch: not in the manifest), then model.safetensors + model.json, curves.png
and manifest.json (kind "run", last: the run is complete). A rerun of a complete run only
reads; one made from other inputs (upstream digests) is refused.

Several seeds at once: `run_stack(configs)` trains runs that differ only by seed (and run name)
in one process, the data read once, each run's folder exactly as alone (docs/train.md, "Several
seeds at once"); `run(cfg)` is a stack of one. From Python: `pipeline.registry.run_train_stack`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from core.config import ConfigError, given_folder
from core.logs import log
from core.seeding import derive_seed, make_generator
from core.version import code_version
from models.annotation import soft_targets
from models.classifiers import build_classifier
from models.objectives import OBJECTIVES, TrainingModule, build_objective
from models.simplex import softmax_targets
from models.training import SeriesIndex, interior_positions, multistep_lr
from shards.datapath import DataPathChoice
from shards.datasets import RealSplit, check_same_classes
from shards.manifest import ShardError, manifest_digest, read_manifest
from shards.runs import split_history, write_run
from stages.common import data as datapath
from stages.common import phases
from stages.common.batches import Mixed, TrainingData
from stages.common.budget import train_run_images
from stages.common.epochs import LoopState, Result
from stages.common.training_run import TrainingRun
from stages.configs.train import Config

# a run name taken by another config: the run's own name is the way out
OTHER_RUN = "choose another run=<name> (or remove the folder to retrain it)"

# ---------------------------------------------------------------- 1. inputs


def mixed_folder(cfg: Config) -> Path:
    default = cfg.root / "mixed"
    if not cfg.mixed:
        return default
    hint = f"point it at a complete mixed folder (annotate's or pull's), or unset it for {default}"
    return given_folder("mixed", cfg.mixed, hint)


def load_mixed(cfg: Config, train: RealSplit, path: DataPathChoice, device: torch.device) -> Mixed:
    folder = mixed_folder(cfg)
    table = datapath.open_series(folder, path, train.class_names, device, train.image_size)
    index = SeriesIndex(table.classes, len(train.class_names))
    if index.missing():
        names = [train.class_names[c] for c in index.missing()]
        raise ShardError(
            f"{folder}: no complete series contains class(es) {names[:5]}; CSM needs all"
        )
    # s re-applied from λ̂ when asked (t_a = σ(s(λ̂ − 0.5)), docs/methods.md §2; k-way: softmax((s/2)λ̂));
    # else the stored soft; the "ratio" ablation trains on the generation weights themselves
    # (t_a = α; k-way: t = w), no re-annotation
    kway = table.mix_classes > 2
    if cfg.loss.csm.targets == "ratio":
        soft = table.alpha
    elif cfg.loss.csm.sharpening:
        sharpen = softmax_targets if kway else soft_targets
        soft = sharpen(table.lambda_hat, cfg.loss.csm.sharpening)
    else:
        soft = table.soft
    log.info(
        "mixed %s: %d complete series x %d members of %d classes (%d incomplete dropped)",
        *(folder, len(table), table.members, table.mix_classes, table.dropped),
    )
    interior = interior_positions(table.alpha[0]) if kway else None
    return Mixed(table.images, table.classes, soft.float(), index, interior)


def data_folders(cfg: Config, needs_mixed: bool) -> list[Path]:
    """Every folder whose images the run reads (what the memory path would hold decoded)."""
    real = cfg.root / "real"
    return [real / "train", real / "val", *([mixed_folder(cfg)] if needs_mixed else [])]


def load_data(
    cfg: Config, path: DataPathChoice, device: torch.device
) -> tuple[RealSplit, RealSplit]:
    real = cfg.root / "real"
    if cfg.train_limit:
        train = datapath.open_head(real / "train", cfg.train_limit, path, device)
    else:
        train = datapath.open_split(real / "train", path, device)
    val = datapath.open_split(real / "val", path, device)
    check_same_classes(f"{real / 'val'}", val.class_names, train.class_names, "real/train")
    return train, val


def upstream(cfg: Config, needs_mixed: bool) -> dict[str, str]:
    """Digests of the folders the run is made from (a missing one: its one-line error)."""
    real = cfg.root / "real"
    digests = {f"real/{s}": manifest_digest(real / s) for s in ("train", "val")}
    if needs_mixed:
        digests["mixed"] = manifest_digest(mixed_folder(cfg))
    return digests


# ---------------------------------------------------------------- the stage


def run(cfg: Config) -> Path:
    """Train one run (see the module docstring); returns the run folder. With `seeds=`, the
    stack of runs <run>-s<seed> (`stack_of`); returns the folder that holds them."""
    if cfg.seeds:
        return run_stack(stack_of(cfg))[0].parent
    return run_stack([cfg])[0]


def stack_of(cfg: Config) -> list[Config]:
    """The runs `seeds=` names: `cfg` with run <run>-s<seed> and that seed, in order."""
    return [replace(cfg, run=f"{cfg.run}-s{s}", seed=s, seeds=()) for s in cfg.seeds]


@dataclass
class Member:
    """One run of a stack: its config, folder and the generator of its epochs."""

    cfg: Config
    run: TrainingRun
    module: TrainingModule
    epochs: Generator[LoopState, None, Result]
    section: Callable[[LoopState, bool], dict[str, Any]]


def run_stack(cfgs: Sequence[Config]) -> list[Path]:
    """Train runs that differ only by `seed` (and `run`, their folders) together in one process;
    returns their folders, in order. What they share is read once: the data (decoded, or its
    stream workers), the normalisation, the validation images; each run keeps its own folder,
    config.json, init, data order, augmentation, checkpoints and resume, and takes its epochs
    in turn with the others, each step exactly the step it takes alone (the same bytes as a
    plain `train` of that seed). Complete runs only read; `run(cfg)` is a stack of one."""
    check_stack(cfgs)
    phases.begin()  # SEMIX_PHASES: the process's start and imports end here
    # 1. Accelerators, the run folders, what they are made from; complete runs only read.
    with phases.phase("open"):
        runs = [TrainingRun.open(c, "train", c.run, OTHER_RUN) for c in cfgs]
    cfg = cfgs[0]
    classes = read_manifest(cfg.root / "real" / "train").class_names
    objective = OBJECTIVES[cfg.loss.name].objective  # how it reads the data, before one is built
    needs_mixed = objective.needs_mixed
    made_from = upstream(cfg, needs_mixed)
    pending = [(c, r) for c, r in zip(cfgs, runs, strict=True) if not r.complete(made_from)]
    if not pending:
        return [r.folder for r in runs]
    for _, r in pending:
        r.check_resume()

    # 2. Data, decoded into device memory or opened for streaming (bad input fails here, before
    #    anything is written); DataLoader workers start now, before the models exist.
    cfg, first = pending[0]
    accelerator, dev = first.accelerator, first.device
    with phases.phase("data"):
        path = datapath.choose_path(cfg, data_folders(cfg, needs_mixed), dev, accelerator)
        train, val = load_data(cfg, path, dev)
        mixed = load_mixed(cfg, train, path, dev) if needs_mixed else None
        mixed_path = mixed_folder(cfg) if needs_mixed else None
        budget = train_run_images(cfg.root, cfg.train_limit, mixed_path)
    if first.main:
        log.info("train %s: %s", ", ".join(c.run for c, _ in pending), path.describe())
    for _, r in pending:
        r.write_config()
    with phases.phase("data"):
        mean, std = datapath.statistics(train, cfg.in_channels, cfg)  # normalisation: real/train
        val = datapath.sequential(val, cfg.eval_batch_size, cfg)
        series = mixed.images if mixed else None
        pixels = datapath.pixel_source(train, series, objective.mixes_rows, accelerator, cfg)
    data = TrainingData(train, val, mean, std, train.image_size, mixed, pixels)
    if path.path == "memory":  # decoded once for the whole stack
        decoded = len(train) + len(val) + (len(mixed.classes) * mixed.soft.shape[1] if mixed else 0)
        phases.count("images_decoded", decoded)

    # 3.-4. Each run's model and optimizer, then their epochs in turn.
    try:
        with phases.phase("models"):
            members = [_member(c, r, data, path, len(classes), budget) for c, r in pending]
        results = _in_turn([m.epochs for m in members])
    finally:
        datapath.close(data.pixels, data.val)

    # 5. Outputs (main): the best epoch's weights with what a reader needs, metrics, curves,
    #    the manifest last.
    for m, result in zip(members, results, strict=True):
        if m.run.main:
            with phases.phase("outputs"):
                _write(m, result, path, classes, data, made_from)
    return [r.done() for r in runs]


def check_stack(cfgs: Sequence[Config]) -> None:
    """A stack is runs of one config that differ only by seed (and run names, all distinct)."""
    if not cfgs:
        raise ConfigError("train stack: no runs given")
    names = [c.run for c in cfgs]
    if len(set(names)) != len(names):
        raise ConfigError(f"train stack: run names repeat ({', '.join(names)}); one each")
    first = cfgs[0].to_dict()
    for c in cfgs[1:]:
        other = c.to_dict()
        differ = [k for k in first if k not in STACK_FREE and first[k] != other.get(k)]
        if differ:
            raise ConfigError(
                f"train stack: run {c.run} differs from {cfgs[0].run} in {', '.join(differ)}; "
                "a stack's runs differ only by seed"
            )


STACK_FREE = ("seed", "run")  # what may differ between the runs of a stack


def _member(
    cfg: Config,
    run: TrainingRun,
    data: TrainingData,
    path: DataPathChoice,
    classes: int,
    budget: Any,
) -> Member:
    """A run's model (+ objective parameters), init from (seed, "init"), its optimizer and the
    generator of its epochs (nothing trains until it is advanced)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.seed, "train", "init"))
        model = build_classifier(cfg.model, classes, cfg.in_channels, pretrained=cfg.pretrained)
    objective = build_objective(
        cfg.loss.name,
        classes,
        generator=make_generator(cfg.seed, "train", "objective-init"),
        num_samples=len(data.train),
        **cfg.loss.params(),
    )
    # channels_last: oneDNN's fast layout for convolutions on CPU as on GPU (bench/RESULTS.md)
    module = TrainingModule(model, objective).to(run.device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(
        module.parameters(),
        lr=cfg.optim.lr,
        momentum=cfg.optim.momentum,
        weight_decay=cfg.optim.weight_decay,
    )
    accelerator = run.accelerator
    log.info(
        "train %s: %s, loss %s, %d train / %d val images, %d process(es) on %s%s",
        *(cfg.run, cfg.model, cfg.loss.name, len(data.train), len(data.val)),
        *(accelerator.num_processes, run.device),
        ", bf16" if accelerator.mixed_precision == "bf16" else "",
    )
    recipe = run.recipe(
        key=(cfg.seed, "train"),
        lr=lambda e: multistep_lr(e, cfg.optim.lr, cfg.optim.milestones, cfg.optim.lr_gamma),
        keep="best",
        lr_field="optim.lr",
    )

    def section(state: LoopState, finished: bool) -> dict[str, Any]:
        return _section(cfg, state, finished, budget)

    epochs = run.fit_epochs(recipe, module, optimizer, data, path, section)
    return Member(cfg, run, module, epochs, section)


def _in_turn(runs: list[Generator[LoopState, None, Result]]) -> list[Result]:
    """Advance each run's epochs in turn, one epoch each, until all are done; their Results."""
    results: dict[int, Result] = {}
    while len(results) < len(runs):
        for i, epochs in enumerate(runs):
            if i not in results:
                try:
                    next(epochs)
                except StopIteration as done:
                    results[i] = done.value
    return [results[i] for i in range(len(runs))]


def _write(
    m: Member,
    result: Result,
    path: DataPathChoice,
    classes: Sequence[str],
    data: TrainingData,
    made_from: dict[str, str],
) -> None:
    """A finished run's outputs (main process), the manifest last."""
    cfg, run, state = m.cfg, m.run, result.state
    net = run.accelerator.unwrap_model(m.module).model
    meta = {
        "arch": net.arch_config(),
        "class_names": list(classes),
        "image_size": data.image_size,
        "normalize": {"mean": data.mean, "std": data.std},
        "run": cfg.run,
        "loss": cfg.loss.name,
        "best_epoch": state.best_epoch,
        "best_val_acc": state.best_val_acc,
        "code_version": code_version(),
    }
    metrics = run.final_metrics(result, path, m.section)  # host.json too
    plots = [run.curves(state.history, f"{cfg.run} ({cfg.loss.name})")]
    write_run(run.folder, result.weights, meta, metrics, plots, made_from)
    log.info(
        "train %s: best epoch %d of %d, val acc %.2f %% -> %s",
        *(cfg.run, state.best_epoch, cfg.epochs, state.best_val_acc, run.folder),
    )


def _section(cfg: Config, state: LoopState, finished: bool, budget: int | None) -> dict[str, Any]:
    """metrics.json's section: what the config, the inputs and the code make of the run, the
    same bytes on any machine (its data path and seconds go to host.json); ``budget``: the
    labelled real/train images behind it (stages/common/budget.py)."""
    return {
        "run": cfg.run,
        "loss": cfg.loss.name,
        "model": cfg.model,
        "loss_params": cfg.loss.params(),
        "epochs": cfg.epochs,
        "best_epoch": state.best_epoch,
        "best_val_acc": state.best_val_acc,
        "history": split_history(state.history)[0],
        "finished": finished,
        "labelled_train_images": budget,
    }
