"""finetune: train/<run>/ -> runs/<classes>/finetune/<run>-<method>/ (METHODS.md §4, §5).

    python -m pipeline finetune --preset digits --set run=ce method=maccal
    make finetune CLASSES=cifar10 RUN=csm METHOD=fedlas-ls

MaC-Cal (§4) freezes the trained backbone in eval mode (BatchNorm statistics stay as trained),
replaces the head by a fresh masked bottleneck and trains only that head with cross-entropy on
real/train: one Bernoulli(q) mask per epoch, MaskedSGD (dropped weights do not move), constant
lr, then q <- RetentionSchedule(acc_t, conf_t). With augmentation on (crop_pad > 0 or flip) the
frozen backbone runs on every augmented batch, without gradients; with it off the features of
real/train are computed once and reused every epoch (same numbers, a fraction of the time).

FeDLaS (§5) continues the whole trained model under FeDLaSCriterion: a fresh gate whose
parameters join the SGD optimizer (same lr and weight decay) but not the gradient clipping.

Both keep the last epoch's weights (no selection on val: evaluate fits its temperature there).
The folder looks like a train run, so evaluate and report.md read it the same way: config.json,
model.safetensors + model.json (MaC-Cal's arch names its head: models.finetuning.build_model),
metrics.json (section "finetune", per-epoch history), curves.png, plus q_trace.json +
q_trace.png (MaC-Cal) or gate.png (FeDLaS). No checkpoints: the stage is short, and since every
draw derives from (seed, method, epoch, purpose), rerunning an unfinished folder starts over and
ends with the weights the uninterrupted run would have had.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from models.calibration import ece, nll, topk_accuracy
from models.classifiers import Classifier
from models.finetuning import GateTracker, arch_with_head, build_model, require_separable_head
from models.heads import (
    GATE_MODES,
    EpochAccConf,
    FeDLaSCriterion,
    MaskedBottleneckHead,
    MaskedSGD,
    RetentionSchedule,
)
from models.training import collect_logits, epoch_batches, normalize, random_crop_flip
from pipeline.configs.finetune import Config
from pipeline.plots import lines
from pipeline.runtime import code_version, log, make_generator, progress
from shards.datasets import RealSplit, check_same_classes, load_real
from shards.io import atomic_write_json, read_json, sha256_file
from shards.manifest import ShardError
from shards.runs import META, WEIGHTS, load_model, save_weights
from shards.writer import write_config

SECTION = "finetune"  # metrics.json section


@dataclass
class Data:
    """real/train and real/val on the device, and how the source run feeds its model."""

    train: RealSplit
    val: RealSplit
    mean: list[float]
    std: list[float]
    image_size: int
    device: torch.device
    bf16: bool

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.bf16 else nullcontext()


# ---------------------------------------------------------------- 1. inputs


def load_source(cfg: Config, device: torch.device) -> tuple[Classifier, dict[str, Any], Path]:
    """The trained run's classifier (weights loaded), its model.json and its folder."""
    folder = cfg.root / "train" / cfg.run
    if not (folder / META).is_file():
        raise ShardError(
            f"run {cfg.run!r} has no trained weights in {folder}; train it first "
            f"(make train RUN={cfg.run})"
        )
    model, meta = load_model(folder, build_model, device)
    require_separable_head(model, f"run {cfg.run!r} ({meta['arch'].get('arch')})")
    return model, meta, folder


def load_data(cfg: Config, meta: dict[str, Any], device: torch.device) -> Data:
    real = cfg.root / "real"
    train, val = load_real(real / "train", device), load_real(real / "val", device)
    check_same_classes(f"run {cfg.run!r}", meta["class_names"], train.class_names, "real/train")
    check_same_classes("real/val", val.class_names, train.class_names, "real/train")
    bf16 = device.type == "cuda" and cfg.precision in ("auto", "bf16")
    norm = meta["normalize"]
    return Data(train, val, norm["mean"], norm["std"], int(meta["image_size"]), device, bf16)


def train_inputs(cfg: Config, data: Data, idx: torch.Tensor, augment: torch.Generator):
    """Normalised (augmented) real/train images of the batch `idx`, as the source run saw them."""
    images = data.train.images[idx]
    if cfg.augments:
        images = random_crop_flip(images, augment, cfg.crop_pad, cfg.flip)
    return normalize(images, data.mean, data.std, data.image_size)


def generators(cfg: Config, epoch: int, device: torch.device):
    """(order, augment) generators of one epoch, derived from (seed, method, epoch, purpose)."""
    key = (cfg.seed, SECTION, cfg.method, "epoch", epoch)
    return make_generator(*key, "order"), make_generator(*key, "augment", device=device)


# ---------------------------------------------------------------- 2. the methods


class MacCal:
    """METHODS §4: frozen backbone, masked bottleneck head, adaptive retention q."""

    replaces_head = True

    def __init__(self, cfg: Config, model: Classifier, data: Data) -> None:
        self.cfg, self.model, self.data = cfg, model, data
        model.requires_grad_(False).eval()  # the backbone: no grads, BatchNorm frozen
        init = make_generator(cfg.seed, SECTION, cfg.method, "head-init")
        self.head = MaskedBottleneckHead(
            model.feature_dim, model.num_classes, cfg.maccal_r, generator=init
        ).to(data.device)
        model.head = self.head
        self.optimizer = MaskedSGD(
            self.head.parameters(),
            self.head.masked_weights,
            lr=cfg.maccal_lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
        )
        self.schedule = RetentionSchedule(**cfg.method_params(), total_epochs=cfg.epochs)
        self.cached = None
        if not cfg.augments:  # un-augmented features never change: compute them once
            _, feats = collect_logits(
                model,
                data.train.images,
                data.mean,
                data.std,
                batch_size=cfg.eval_batch_size,
                device=data.device,
                image_size=data.image_size,
                features=True,
            )
            self.cached = feats.to(data.device)

    @torch.no_grad()
    def features(self, idx: torch.Tensor, augment: torch.Generator) -> torch.Tensor:
        if self.cached is not None:
            return self.cached[idx]
        with self.data.autocast():
            return self.model.forward_features(train_inputs(self.cfg, self.data, idx, augment))

    def train_epoch(self, epoch: int, bar: Any) -> dict[str, Any]:
        cfg, data, head = self.cfg, self.data, self.head
        order, augment = generators(cfg, epoch, data.device)
        mask_gen = make_generator(cfg.seed, SECTION, cfg.method, "epoch", epoch, "mask")
        q = self.schedule.q
        head.draw_masks(q, mask_gen)  # M ~ Bernoulli(q) for the whole epoch, W <- M ⊙ W
        stats, loss_sum = EpochAccConf(), torch.zeros((), dtype=torch.float64, device=data.device)
        for idx in epoch_batches(len(data.train), cfg.batch_size, order):
            idx = idx.to(data.device)
            y = data.train.labels[idx]
            logits = head(self.features(idx, augment).float())
            loss = F.cross_entropy(logits, y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()  # masked: dropped weights and their momentum stay put
            stats.update(logits, y)
            loss_sum += loss.detach().double() * len(idx)
            bar.update(len(idx))
        acc, conf = stats.compute()
        self.schedule.update(epoch, acc, conf)  # q for the next epoch
        return {
            "loss": float(loss_sum) / float(stats.totals[2]),
            "train_acc": 100.0 * acc,
            "train_conf": 100.0 * conf,
            "q": q,
            "q_next": self.schedule.q,
            "tau": self.schedule.history[-1]["tau"],
            "kept": {
                "w1": float(head.mask1.float().mean()),
                "w2": float(head.mask2.float().mean()),
            },
        }

    @staticmethod
    def describe(s: dict[str, Any]) -> str:
        return f"q {s['q']:.3f} -> {s['q_next']:.3f}, train conf {s['train_conf']:.1f} %"

    def write_trace(self, run_dir: Path) -> None:
        atomic_write_json(run_dir / "q_trace.json", self.schedule.state_dict())

    def plot(self, run_dir: Path, history: list[dict[str, Any]]) -> None:
        lines(
            {
                "q": [h["q"] for h in history],
                "train acc": [h["train_acc"] / 100 for h in history],
                "train conf": [h["train_conf"] / 100 for h in history],
            },
            run_dir / "q_trace.png",
            xlabel="epoch",
            title=f"MaC-Cal retention ({self.cfg.output})",
        )


class FeDLaS:
    """METHODS §5 as a fine-tuning stage: the whole model continues under FeDLaSCriterion."""

    replaces_head = False

    def __init__(self, cfg: Config, model: Classifier, data: Data) -> None:
        self.cfg, self.model, self.data = cfg, model, data
        init = make_generator(cfg.seed, SECTION, cfg.method, "gate-init")
        variant = cfg.method.removeprefix("fedlas-")
        self.criterion = FeDLaSCriterion(
            model.num_classes, variant, generator=init, **cfg.method_params()
        ).to(data.device)
        self.optimizer = torch.optim.SGD(
            [*model.parameters(), *self.criterion.gate_parameters()],
            lr=cfg.fedlas_lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
        )
        self.tracker = GateTracker(len(data.train), data.device)

    def train_epoch(self, epoch: int, bar: Any) -> dict[str, Any]:
        cfg, data, model, criterion = self.cfg, self.data, self.model, self.criterion
        order, augment = generators(cfg, epoch, data.device)
        model.train()
        criterion.train()  # NCI statistics move in training mode only
        sums = torch.zeros(3, dtype=torch.float64, device=data.device)  # loss, correct, Σr
        n = 0
        for idx in epoch_batches(len(data.train), cfg.batch_size, order):
            idx = idx.to(data.device)
            y = data.train.labels[idx]
            x = train_inputs(cfg, data, idx, augment)
            with data.autocast():
                h = model.forward_features(x)
                logits = model.head(h)
            loss, stats = criterion(h.float(), logits.float(), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.clip_norm > 0:  # the classifier only: the gate is left out (METHODS §5)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
            self.optimizer.step()
            self.tracker.update(idx, stats["psi"])
            correct = (logits.detach().argmax(dim=1) == y).sum()
            sums += torch.stack(
                [loss.detach().double() * len(y), correct.double(), stats["r"].sum().double()]
            )
            n += len(y)
            bar.update(len(idx))
        loss_sum, correct, r_sum = sums.tolist()
        return {
            "loss": loss_sum / n,
            "train_acc": 100.0 * correct / n,
            "r_mean": r_sum / n,
            "nci_mu": float(criterion.nci.mu),
            "nci_sigma": float(criterion.nci.sigma),
            **self.tracker.end_epoch(),  # mode_share {+1, -1, 0}, flip_rate
        }

    @staticmethod
    def describe(s: dict[str, Any]) -> str:
        share = "/".join(f"{s['mode_share'][m]:.2f}" for m in GATE_MODES)
        flip = "-" if s["flip_rate"] is None else f"{s['flip_rate']:.3f}"
        return f"gate +1/-1/0 {share}, flip {flip}, mean r {s['r_mean']:.4f}"

    def write_trace(self, run_dir: Path) -> None:
        """The gate statistics live in metrics.json's history."""

    def plot(self, run_dir: Path, history: list[dict[str, Any]]) -> None:
        series = {f"ψ = {m}": [h["mode_share"][m] for h in history] for m in GATE_MODES}
        series["flip rate"] = [h["flip_rate"] or 0.0 for h in history]
        lines(
            series, run_dir / "gate.png", xlabel="epoch", title=f"FeDLaS gate ({self.cfg.output})"
        )


METHODS = {"maccal": MacCal, "fedlas-ls": FeDLaS, "fedlas-mbls": FeDLaS}


# ---------------------------------------------------------------- 3. outputs


def validate(model: torch.nn.Module, data: Data, batch_size: int) -> dict[str, float]:
    logits = collect_logits(
        model,
        data.val.images,
        data.mean,
        data.std,
        batch_size=batch_size,
        device=data.device,
        image_size=data.image_size,
    )
    labels = data.val.labels.cpu()
    return {
        "val_acc": 100.0 * topk_accuracy(logits, labels),
        "val_ece": 100.0 * ece(logits, labels),
        "val_nll": nll(logits, labels),
    }


def write_metrics(run_dir: Path, section: dict[str, Any]) -> None:
    """metrics.json is shared with evaluate: keep its other sections."""
    path = run_dir / "metrics.json"
    metrics = read_json(path) if path.is_file() else {}
    metrics[SECTION] = section
    atomic_write_json(path, metrics)


def is_finished(run_dir: Path) -> bool:
    path = run_dir / "metrics.json"
    done = path.is_file() and read_json(path).get(SECTION, {}).get("finished", False)
    return bool(done) and (run_dir / META).is_file()


# ---------------------------------------------------------------- the stage


def run(cfg: Config) -> Path:
    """Fine-tune one trained run (see the module docstring); returns the output folder."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run_dir = cfg.root / SECTION / cfg.output
    if is_finished(run_dir):
        write_config(run_dir, cfg.to_dict())  # refuses another config under the same name
        log.info("finetune %s: already finished (%s); nothing to do", cfg.output, run_dir)
        return run_dir

    # 1. Inputs: bad input fails here, before anything is written.
    model, meta, source = load_source(cfg, device)
    data = load_data(cfg, meta, device)
    write_config(run_dir, cfg.to_dict())
    source_info = {
        "run": cfg.run,
        "folder": f"train/{cfg.run}",
        "loss": meta.get("loss", ""),
        "weights_sha256": sha256_file(source / WEIGHTS),
    }

    # 2. The method (fresh head or gate from (seed, method, purpose)).
    method = METHODS[cfg.method](cfg, model, data)
    log.info(
        "finetune %s: %s on run %s (%s, loss %s), %d train / %d val images on %s%s",
        *(cfg.output, cfg.method, cfg.run, meta["arch"].get("arch"), source_info["loss"] or "?"),
        *(len(data.train), len(data.val), device, ", bf16" if data.bf16 else ""),
    )

    # 3. Epochs: train, validate, log, write the history.
    history: list[dict[str, Any]] = []
    total = cfg.epochs * len(data.train)
    with progress(range(total), total=total, desc=f"finetune {cfg.output}", unit="img") as bar:
        for epoch in range(cfg.epochs):
            t0 = time.perf_counter()
            stats = method.train_epoch(epoch, bar)
            seconds = time.perf_counter() - t0
            stats |= validate(model, data, cfg.eval_batch_size)
            stats |= {"epoch": epoch, "seconds": round(seconds, 3)}
            history.append(stats)
            method.write_trace(run_dir)
            write_metrics(run_dir, _section(cfg, source_info, history, finished=False))
            log.info(
                "epoch %d/%d: loss %.4f, train acc %.1f %%, val acc %.2f %%, val ECE %.2f %%, %s",
                *(epoch + 1, cfg.epochs, stats["loss"], stats["train_acc"]),
                *(stats["val_acc"], stats["val_ece"], method.describe(stats)),
            )

    # 4. Final weights (the last epoch's) with what evaluate needs to rebuild them, plots.
    out_meta = {
        "arch": arch_with_head(model) if method.replaces_head else meta["arch"],
        "class_names": list(meta["class_names"]),
        "image_size": data.image_size,
        "normalize": meta["normalize"],
        "run": cfg.output,
        "loss": f"{source_info['loss']}+{cfg.method}" if source_info["loss"] else cfg.method,
        "method": cfg.method,
        "source": source_info,
        "epochs": cfg.epochs,
        "code_version": code_version(),
    }
    save_weights(run_dir, model.state_dict(), out_meta)
    write_metrics(run_dir, _section(cfg, source_info, history, finished=True))
    lines(
        {
            "val acc (%)": [h["val_acc"] for h in history],
            "val ECE (%)": [h["val_ece"] for h in history],
        },
        run_dir / "curves.png",
        xlabel="epoch",
        title=f"{cfg.output} ({out_meta['loss']})",
    )
    method.plot(run_dir, history)
    last = history[-1]
    log.info(
        "finetune %s: val acc %.2f %%, val ECE %.2f %% -> %s",
        *(cfg.output, last["val_acc"], last["val_ece"], run_dir),
    )
    return run_dir


def _section(
    cfg: Config, source: dict[str, Any], history: list[dict[str, Any]], finished: bool
) -> dict[str, Any]:
    return {
        "run": cfg.output,
        "method": cfg.method,
        "method_params": cfg.method_params(),
        "source": source,
        "epochs": cfg.epochs,
        "history": history,
        "finished": finished,
    }
