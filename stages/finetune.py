"""finetune: train/<run>/ -> runs/<classes>/finetune/<run>-<objective>/ (docs/methods.md §4, §5).

    python -m pipeline finetune --preset digits --set run=ce objective=maccal
    make finetune CLASSES=cifar10 RUN=csm OBJECTIVE=fedlas-ls
    torchrun --nproc_per_node 2 -m pipeline finetune ...     (CPU, gloo)

The trained run's classifier goes through the same training loop as `train` (stages/common/epochs.py:
accelerate, checkpoints after every epoch, resume, progress), with a constant lr, and the last
epoch's weights are kept (no selection on val: evaluate fits its temperature there):

- FeDLaS (docs/methods.md §5) is training with `init=` the trained run and the FeDLaS objective
  (the loss= fedlas-* of `train`): the whole model continues, a fresh gate joins the SGD
  optimizer (same lr and weight decay) but not the gradient clipping.
- MaC-Cal (docs/methods.md §4) is the objective `models.objectives.MacCalObjective`: the backbone
  frozen in eval mode (BatchNorm statistics stay as trained), a fresh masked bottleneck head
  trained with cross-entropy under MaskedSGD, one Bernoulli(q) mask per epoch, then
  q <- RetentionSchedule.
  With augmentation off (augment.crop_pad=0, augment.flip=false) the features of real/train are
  computed once.

Folder, laid out like a train run: config.json, checkpoints/, metrics.json (section
"finetune"), host.json (this machine's data path and seconds: not in the manifest),
model.safetensors + model.json (MaC-Cal's arch names its head:
models.finetuning.build_model), curves.png, q_trace.json + q_trace.png (MaC-Cal) or gate.png
(FeDLaS), and manifest.json last (upstream: real/train, real/val and the trained run).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from core.io import atomic_write_json, read_json
from core.logs import log
from core.plots import lines
from core.seeding import make_generator
from core.version import code_version
from models.classifiers import Classifier
from models.fedlas import GATE_MODES
from models.finetuning import arch_with_head, build_model, require_separable_head
from models.heads import MaskedSGD, RetentionSchedule
from models.objectives import Objective, TrainingModule, build_objective, maccal
from models.training import collect_logits
from shards.datapath import DataPathChoice
from shards.datasets import check_same_classes
from shards.manifest import manifest_digest
from shards.runs import Run, read_run, split_history, write_run
from stages.common import data as datapath
from stages.common.batches import TrainingData
from stages.common.budget import labelled_images
from stages.common.epochs import LoopState
from stages.common.training_run import TrainingRun
from stages.configs.finetune import Config

SECTION = "finetune"  # metrics.json section and the first key of every draw
# what a fine-tuning objective sets up: the objective, optimizer, constant lr and end-of-run plots
Setup = tuple[Objective, torch.optim.Optimizer, float, list[Callable[[Path], Any]]]


# ---------------------------------------------------------------- 1. inputs


def load_source(cfg: Config) -> tuple[Run, Classifier]:
    """The trained run (complete, or one line saying why not) and its classifier, no weights
    loaded yet."""
    source = read_run(cfg.root / "train" / cfg.run, cfg.classes_file or cfg.preset)
    model = build_model(source.meta["arch"])
    require_separable_head(model, f"run {cfg.run!r} ({source.meta['arch'].get('arch')})")
    return source, model


def load_data(cfg: Config, source: Run, accelerator: Any) -> tuple[TrainingData, DataPathChoice]:
    """real/train and real/val through the data path (stages/common/data.py), with the run's own
    normalisation; pixels for the steps come later (`pixel_source`, once the objective is known).
    The training images are the source run's own (its train_limit): fine-tuning on more labels
    than Stage I saw would compare methods on different labelled budgets."""
    real, dev, meta = cfg.root / "real", accelerator.device, source.meta
    path = datapath.choose_path(cfg, [real / "train", real / "val"], dev, accelerator)
    train = datapath.open_split(real / "train", path, dev)
    limit = source_train_limit(source)
    if limit:
        train = datapath.head(train, limit)
    val = datapath.open_split(real / "val", path, dev)
    check_same_classes(f"run {cfg.run!r}", meta["class_names"], train.class_names, "real/train")
    check_same_classes("real/val", val.class_names, train.class_names, "real/train")
    if accelerator.is_main_process:
        log.info("finetune %s: %s", cfg.output, path.describe())
    val = datapath.sequential(val, cfg.eval_batch_size, cfg)
    norm = meta["normalize"]
    return TrainingData(train, val, norm["mean"], norm["std"], int(meta["image_size"])), path


def source_train_limit(source: Run) -> int:
    """The train_limit the source run was trained with (its config.json; 0 = all)."""
    return int(read_json(source.folder / "config.json").get("train_limit", 0))


# ---------------------------------------------------------------- 2. each objective's setup


def maccal_setup(cfg: Config, model: Classifier, data: TrainingData) -> Setup:
    """docs/methods.md §4: frozen backbone, masked bottleneck head, adaptive retention q."""
    features = None
    if not cfg.augments:  # un-augmented features never change: compute them once
        train = datapath.sequential(data.train, cfg.eval_batch_size, cfg)
        try:
            _, features = collect_logits(
                model,
                train.images,
                data.mean,
                data.std,
                batch_size=cfg.eval_batch_size,
                image_size=data.image_size,
                features=True,
            )
        finally:
            datapath.close(train)
        features = features.to(data.train.labels.device)
    schedule = RetentionSchedule(**cfg.objective_params(), total_epochs=cfg.epochs)
    init = make_generator(cfg.seed, SECTION, cfg.objective, "head-init")
    objective = maccal(model, cfg.maccal.r, schedule, init, features)
    head = model.head
    optimizer = MaskedSGD(
        head.parameters(),
        head.masked_weights,
        lr=cfg.maccal.lr,
        momentum=cfg.optim.momentum,
        weight_decay=cfg.optim.weight_decay,
    )

    def q_trace(folder: Path) -> None:
        atomic_write_json(folder / "q_trace.json", schedule.state_dict())
        history = schedule.history
        series = {
            "q": [h["q"] for h in history],
            "train acc": [h["acc"] for h in history],
            "train conf": [h["conf"] for h in history],
        }
        title = f"MaC-Cal retention ({cfg.output})"
        lines(series, folder / "q_trace.png", xlabel="epoch", title=title)

    return objective, optimizer, cfg.maccal.lr, [q_trace]


def fedlas_setup(cfg: Config, model: Classifier, data: TrainingData) -> Setup:
    """docs/methods.md §5: the whole model continues under the FeDLaS objective of `train`."""
    objective = build_objective(
        cfg.objective,
        model.num_classes,
        generator=make_generator(cfg.seed, SECTION, cfg.objective, "gate-init"),
        num_samples=len(data.train),
        **cfg.objective_params(),
    )
    params = [*model.parameters(), *objective.parameters()]  # the gate: same lr and decay
    optimizer = torch.optim.SGD(
        params, lr=cfg.fedlas.lr, momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay
    )
    return objective, optimizer, cfg.fedlas.lr, []


# {objective=: its setup} (stages/configs/finetune.OBJECTIVES); the study's methods are another
# registry (pipeline/study/config.py)
SETUPS: dict[str, Callable[[Config, Classifier, TrainingData], Setup]] = {
    "maccal": maccal_setup,
    "fedlas-ls": fedlas_setup,
    "fedlas-mbls": fedlas_setup,
}


def describe(stats: dict[str, Any]) -> str:
    """The objective's part of an epoch's log line."""
    if "q" in stats:
        return (
            f"q {stats['q']:.3f} -> {stats['q_next']:.3f}, train conf {stats['train_conf']:.1f} %"
        )
    share = "/".join(f"{stats['mode_share'][m]:.2f}" for m in GATE_MODES)
    flip = "-" if stats["flip_rate"] is None else f"{stats['flip_rate']:.3f}"
    return f"gate +1/-1/0 {share}, flip {flip}, mean r {stats['r_mean']:.4f}"


# ---------------------------------------------------------------- the stage


def run(cfg: Config) -> Path:
    """Fine-tune one trained run (see the module docstring); returns the output folder."""
    # 1. Inputs: bad input fails here, before anything is written; a complete output only reads.
    run = TrainingRun.open(cfg, SECTION, cfg.output)
    accelerator, dev = run.accelerator, run.device
    source, model = load_source(cfg)
    real = cfg.root / "real"
    made_from = {f"real/{s}": manifest_digest(real / s) for s in ("train", "val")}
    made_from["init"] = source.digest
    if run.complete(made_from):
        return run.folder
    run.check_resume()
    meta = source.meta
    data, path = load_data(cfg, source, accelerator)
    model.load_state_dict(source.state_dict())  # sha256 checked against the run's manifest
    model.to(dev)
    run.write_config()

    # 2. The objective: a fresh head or gate from (seed, objective, purpose), its optimizer.
    objective, optimizer, lr, plots = SETUPS[cfg.objective](cfg, model, data)
    module = TrainingModule(model, objective).to(dev)
    data.pixels = datapath.pixel_source(data.train, None, objective.mixes_rows, accelerator, cfg)
    loss = meta.get("loss", "")
    log.info(
        "finetune %s: %s on run %s (%s, loss %s), %d train / %d val images, %d process(es) on %s",
        *(cfg.output, cfg.objective, cfg.run, meta["arch"].get("arch"), loss or "?"),
        *(len(data.train), len(data.val), accelerator.num_processes, dev),
    )

    # 3. The loop: constant lr, the last epoch's weights (FeDLaS clips the classifier only;
    #    MaC-Cal clips nothing).
    lr_field = "maccal.lr" if cfg.objective == "maccal" else "fedlas.lr"
    key = (cfg.seed, SECTION, cfg.objective)  # the draw key: the same words as before
    recipe = run.recipe(key=key, lr=lambda epoch: lr, keep="last", lr_field=lr_field)
    source_info = {
        "run": cfg.run,
        "folder": f"train/{cfg.run}",
        "loss": loss,
        "weights_sha256": source.manifest.info["weights_sha256"],
    }

    budget = labelled_images(cfg.root, "train", cfg.run)

    def section(state: LoopState, finished: bool) -> dict[str, Any]:
        return {
            "run": cfg.output,
            # metrics.json keeps its keys (`method`, `method_params`): outputs already recorded
            "method": cfg.objective,
            "method_params": cfg.objective_params(),
            "source": source_info,
            "epochs": cfg.epochs,
            "history": split_history(state.history)[0],  # seconds: host.json
            "finished": finished,
            # the source run's images and every part behind them (stages/common/budget.py)
            "labelled_train_images": budget,
        }

    result = run.fit(recipe, module, optimizer, data, path, section, describe)

    # 4. Outputs (main): weights with what evaluate needs to rebuild them, metrics, plots,
    #    the manifest last.
    if run.main:
        history = result.state.history
        out_meta = {
            "arch": arch_with_head(model) if cfg.objective == "maccal" else meta["arch"],
            "class_names": list(meta["class_names"]),
            "image_size": data.image_size,
            "normalize": meta["normalize"],
            "run": cfg.output,
            "loss": f"{loss}+{cfg.objective}" if loss else cfg.objective,
            "method": cfg.objective,  # meta.json's key, kept (evaluate reads it)
            "source": source_info,
            "epochs": cfg.epochs,
            "code_version": code_version(),
        }

        def gate_png(folder: Path) -> None:
            series = {f"ψ = {m}": [h["mode_share"][m] for h in history] for m in GATE_MODES}
            series["flip rate"] = [h["flip_rate"] or 0.0 for h in history]
            title = f"FeDLaS gate ({cfg.output})"
            lines(series, folder / "gate.png", xlabel="epoch", title=title)

        curves_png = run.curves(history, f"{cfg.output} ({out_meta['loss']})")
        plots = [curves_png, *(plots or [gate_png])]
        metrics = run.final_metrics(result, path, section)  # host.json too
        write_run(run.folder, result.weights, out_meta, metrics, plots, made_from)
        last = history[-1]
        log.info(
            "finetune %s: val acc %.2f %%, val ECE %.2f %% -> %s",
            *(cfg.output, last["val_acc"], last["val_ece"], run.folder),
        )
    return run.done()
