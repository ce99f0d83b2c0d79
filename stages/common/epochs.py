"""The classifier's epochs on the one training loop (stages/common/loop.py): train and finetune
call them.

    accelerator = make_accelerator(cfg.precision)
    module = TrainingModule(model, objective)
    result = drain(fit_epochs(run_dir, recipe, module, optimizer, data, accelerator, name))
    write_run(run_dir, result.weights, meta, metrics, plots, upstream)  # shards/runs.py

A unit is an epoch (`Epochs`): train, validate on real/val, keep the best weights. What a
classifier trains is the stages' business (a fresh classifier and a loss; a trained run and
FeDLaS; a frozen backbone and MaC-Cal's head: models/objectives.py); this module does the rest,
the same way for all: the rank guard (the main process writes), progress (tqdm with rates).

Process independence: each epoch is planned first (`plan_steps`, stages/common/batches.py: the
*global* batches and their CSM members), a `PixelSource` serves each planned step's pixels
(device tensors, or shards decoded ahead by DataLoader workers: stages/common/data.py), every
step augments and applies the objective's `prepare` (mixup) to the global batch as a whole
(`make_batch`), and each process then keeps rows rank::world; its loss is weighted by its share of the batch, so DDP's gradient average is
the global batch mean. Every draw comes from a generator derived from (recipe.key, epoch,
purpose), so a resumed run replays the uninterrupted one bit for bit on CPU. What still depends
on the number of processes: BatchNorm normalises with each process's batch statistics
(SyncBatchNorm runs on GPUs only) and sums are taken in another order (docs/train.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from torch import Tensor

from core.logs import log, progress
from core.precision import FROM_ACCELERATE
from core.seeding import make_generator
from core.tracking import scalars
from models.calibration import ece, nll, topk_accuracy
from models.objectives import TrainingModule
from models.training import (
    collect_logits,
    epoch_batches,
    is_channels_last,
)
from shards.checkpoints import CheckpointError
from shards.prefetch import PixelSource
from stages.common import phases
from stages.common.batches import Recipe, TrainingData, make_batch, plan_steps
from stages.common.loop import PRECISION_KEY, train_units

BEST = "best.safetensors"  # in a checkpoint: the best weights so far (keep="best")
OBJECTIVE = "objective.safetensors"  # in a checkpoint: the objective's tensor state


@dataclass
class LoopState:
    """What a checkpoint adds to accelerate's state: where we are and what we have seen.
    `next_epoch` counts the epochs done; `best_epoch` and each history entry's `epoch` number
    epochs from 1, as the logs, curves and checkpoint names do."""

    next_epoch: int = 0
    best_epoch: int = -1
    best_val_acc: float = -1.0
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Result:
    state: LoopState
    weights: dict[str, Tensor]  # the kept weights (the main process's are the ones written)


# ---------------------------------------------------------------- one epoch


def train_epoch(
    recipe: Recipe,
    epoch: int,
    accelerator: Accelerator,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: TrainingData,
    bar: Any,
) -> dict[str, Any]:
    """One epoch; no host-device sync inside the loop (totals stay on the device)."""
    dev, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    key = (*recipe.key, "epoch", epoch)
    order = make_generator(*key, "order")
    augment = make_generator(*key, "augment", device=dev)
    extra = make_generator(*key, "objective", device=dev)
    inner = accelerator.unwrap_model(module)
    net, objective = inner.model, inner.objective
    lr = recipe.lr(epoch)
    for group in optimizer.param_groups:
        group["lr"] = lr
    module.train()
    objective.start_epoch(epoch, net, lambda purpose: make_generator(*key, purpose))
    clip = list(objective.clip_parameters(net)) if recipe.clip_norm > 0 else []
    sums = torch.zeros(2, dtype=torch.float64, device=dev)  # loss sum, correct
    count, losses = 0, []  # each step's loss, kept on the device: checked once, after the epoch
    batches = epoch_batches(len(data.train), recipe.batch_size, order, 2 * world)
    plans = plan_steps(data, [b.to(dev) for b in batches], extra)
    assert data.pixels is not None  # fit provides one
    for plan, pixels in zip(plans, data.pixels.batches(plans), strict=True):
        idx = plan.idx
        batch = make_batch(recipe, data, plan, pixels, augment, extra, objective, rank, world)
        optimizer.zero_grad(set_to_none=True)
        loss, logits = module(**batch)
        n = batch["y"].numel()
        # DDP averages the processes' gradients: weight each by its share of the global batch
        accelerator.backward(loss if world == 1 else loss * (n * world / len(idx)))
        if clip:
            accelerator.clip_grad_norm_(clip, recipe.clip_norm)
        optimizer.step()
        logits = logits.detach()
        objective.observe(batch, logits)
        correct = (logits.argmax(dim=1) == batch["y"]).sum()
        sums += torch.stack([loss.detach().double() * n, correct.double()])
        losses.append(loss.detach())
        count += n
        bar.update(len(idx))
    # the epoch's one sync: its totals, with how many steps' losses were non-finite and whether
    # the weights still are finite (a NaN never heals: a diverged run is stopped, not finished)
    finite = torch.isfinite(torch.stack(losses)) if losses else sums.new_ones(0).bool()
    weights = all_finite(net).logical_not()
    bad = torch.stack([finite.logical_not().sum().double(), weights.double()])
    totals = torch.cat([sums, sums.new_tensor([count]), bad])
    loss_sum, correct, count, bad_steps, bad_weights = accelerator.reduce(totals, "sum").tolist()
    if bad_steps or bad_weights:
        raise diverged(recipe, epoch, lr, losses, finite, accelerator)
    stats = {"lr": lr, "loss": loss_sum / count, "train_acc": 100.0 * correct / count}
    return stats | objective.end_epoch(epoch, net, lambda t: accelerator.reduce(t, "sum"))


class Diverged(ValueError):
    """The loss or the weights became non-finite: the run stops before its epoch's checkpoint,
    so it has no manifest, and its last checkpoint (if any) holds finite weights."""


def all_finite(net: torch.nn.Module) -> Tensor:
    """Whether every floating parameter and buffer of `net` is finite (a device bool, no sync)."""
    tensors = [t for t in (*net.parameters(), *net.buffers()) if t.is_floating_point()]
    return torch.stack([torch.isfinite(t).all() for t in tensors]).all()


def likely_cause(recipe: Recipe, lr: float) -> str:
    return (
        f"the likely cause: {recipe.lr_field}={lr:g} too large for this model and data, or "
        f"a non-finite input; rerun with a smaller {recipe.lr_field} (the run has no manifest: "
        "a rerun with another value starts it over)"
    )


def diverged(
    recipe: Recipe,
    epoch: int,
    lr: float,
    losses: list[Tensor],
    finite: Tensor,
    accelerator: Accelerator,
) -> Diverged:
    """The one line that says where the run diverged (the first step whose loss is non-finite
    on any process, numbered from 1 within the epoch) and the likely cause; every process
    computes it (the gather is collective)."""
    steps = len(losses)
    local = finite.logical_not().nonzero()
    mine = int(local[0]) if len(local) else steps
    first = int(accelerator.gather(finite.new_tensor([mine], dtype=torch.long)).min())
    cause = likely_cause(recipe, lr)
    if first < steps:
        value = float(losses[first]) if first == mine else float("nan")
        return Diverged(
            f"the loss is {value} at epoch {epoch + 1}, step {first + 1} of {steps}: the run "
            f"diverged and is stopped; {cause}"
        )
    return Diverged(
        f"the weights hold non-finite values after epoch {epoch + 1} (every step's loss was "
        f"finite): the run diverged and is stopped; {cause}"
    )


def validate(model: torch.nn.Module, data: TrainingData, batch_size: int) -> dict[str, float]:
    """fp32 eval-mode metrics on real/val (accuracy and ECE in %)."""
    logits = collect_logits(
        model,
        data.val.images,
        data.mean,
        data.std,
        batch_size=batch_size,
        image_size=data.image_size,
    )
    labels = data.val.labels.cpu()
    return {
        "val_acc": 100.0 * topk_accuracy(logits, labels),
        "val_ece": 100.0 * ece(logits, labels),
        "val_nll": nll(logits, labels),
    }


class Epochs:
    """The classifier's units: one epoch each (train, validate on real/val, keep the best
    weights), checkpoint_<n> after epoch n. `on_epoch` (main process) sees the state after each
    checkpoint, `describe` adds to the epoch's log line."""

    files = (BEST, OBJECTIVE)

    def __init__(
        self,
        recipe: Recipe,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data: TrainingData,
        accelerator: Accelerator,
        name: str,
        on_epoch: Callable[[LoopState], None],
        describe: Callable[[dict[str, Any]], str],
    ) -> None:
        self.recipe, self.module, self.optimizer, self.data = recipe, module, optimizer, data
        self.accelerator, self.name, self.on_epoch, self.describe = (
            accelerator, name, on_epoch, describe
        )  # fmt: skip
        inner = accelerator.unwrap_model(module)
        self.net, self.objective = inner.model, inner.objective
        self.count = recipe.epochs
        self.computes = FROM_ACCELERATE[accelerator.mixed_precision]
        self.state, self.best = LoopState(), None
        self.stats: dict[str, Any] = {}  # the last epoch's

    def restore(self, path: Path, saved: dict[str, Any], tensors: dict[str, Any]) -> int:
        """The loop's state, the objective's and the best weights of checkpoint `path`, which
        must have been computed in this process's precision."""
        if "loop" not in saved:
            raise CheckpointError(
                f"{path} was written by an older semix; start over (checkpoint.resume=) or remove it"
            )
        computed = saved.get(PRECISION_KEY, self.computes)
        if computed != self.computes:
            raise CheckpointError(
                f"{path} was computed in {computed}, this process computes in {self.computes}; "
                f"resume it in {computed} (accelerate launch --mixed_precision), or start over "
                f"(checkpoint.resume=)"
            )
        self.state = LoopState(**saved["loop"])
        self.objective.load_extra_state(saved["objective"] | tensors.get(OBJECTIVE, {}))
        self.best = tensors.get(BEST)
        log.info("%s: resumed from %s (epoch %d done)", self.name, path, self.state.next_epoch)
        return self.state.next_epoch

    def bar(self, done: int) -> Any:
        """Progress in images."""
        remaining = (self.count - done) * len(self.data.train)
        main = self.accelerator.is_main_process
        return progress(range(remaining), total=remaining, desc=self.name, unit="img", enabled=main)

    def train(self, epoch: int, bar: Any) -> None:
        """Train and validate (main process) one epoch; keep its weights if they are the best."""
        recipe, state, data = self.recipe, self.state, self.data
        t0 = time.perf_counter()
        with phases.phase("steps"):
            try:
                stats = train_epoch(
                    recipe, epoch, self.accelerator, self.module, self.optimizer, data, bar
                )
            except Diverged as e:  # the run's name first, as every line of this run
                raise Diverged(f"{self.name}: {e}") from None
        seconds = time.perf_counter() - t0
        main = self.accelerator.is_main_process
        with phases.phase("validation"):
            scores = [validate(self.net, data, recipe.eval_batch_size) if main else None]
        phases.count("epochs")
        phases.count("images_validated", len(data.val) if main else 0)
        stats |= broadcast_object_list(scores, from_process=0)[0]
        if not all(math.isfinite(stats[k]) for k in ("val_ece", "val_nll")):  # logits overflow
            raise Diverged(
                f"{self.name}: val ECE {stats['val_ece']}, val NLL {stats['val_nll']} after "
                f"epoch {epoch + 1} (the weights are finite, their logits are not): the run "
                f"diverged and is stopped; {likely_cause(recipe, recipe.lr(epoch))}"
            )
        stats |= {
            "epoch": epoch + 1,  # epochs count from 1 wherever a person reads them
            "seconds": round(seconds, 3),
            "images_per_s": round(len(data.train) / seconds, 1),
        }
        if recipe.keep == "best" and stats["val_acc"] > state.best_val_acc:
            state.best_val_acc, state.best_epoch = stats["val_acc"], epoch + 1
            self.best = {k: v.detach().cpu().clone() for k, v in self.net.state_dict().items()}
        state.history.append(stats)
        state.next_epoch = epoch + 1
        self.stats = stats

    def checkpoint(self, epoch: int) -> tuple[int, dict[str, Any], dict[str, dict[str, Tensor]]]:
        """checkpoint_<n> after epoch n: the loop's state, the objective's, the best weights."""
        extra = self.objective.extra_state()
        files = {OBJECTIVE: {k: v for k, v in extra.items() if isinstance(v, Tensor)}}
        files = {k: v for k, v in ({BEST: self.best} | files).items() if v}
        json_state = {k: v for k, v in extra.items() if not isinstance(v, Tensor)}
        state = {"loop": asdict(self.state), "objective": json_state, PRECISION_KEY: self.computes}
        return epoch + 1, state, files

    def report(self, epoch: int) -> None:
        """`on_epoch`, the trackers, the epoch's log line."""
        stats, recipe = self.stats, self.recipe
        if self.accelerator.is_main_process:
            self.on_epoch(self.state)
        # the trackers (main process; none without tracker=): the epoch's numbers, at the
        # epoch metrics.json records
        numbers = scalars({k: v for k, v in stats.items() if k != "epoch"})
        self.accelerator.log(numbers, step=stats["epoch"])
        described = self.describe(stats)
        log.info(
            "epoch %d/%d: loss %.4f, train acc %.1f %%, val acc %.2f %%, val ECE %.2f %%, "
            "lr %.3g, %.0f img/s%s",
            epoch + 1,
            recipe.epochs,
            *(stats[k] for k in ("loss", "train_acc", "val_acc", "val_ece", "lr")),
            stats["images_per_s"],
            ", " + described if described else "",
        )

    def result(self) -> Result:
        """The state and the kept weights: the best epoch's, or the last's (keep="last")."""
        best = self.best
        if self.recipe.keep == "last" or best is None:
            best = {k: v.detach().cpu().clone() for k, v in self.net.state_dict().items()}
        return Result(self.state, best)


def fit_epochs(
    run_dir: Path,
    recipe: Recipe,
    module: TrainingModule,
    optimizer: torch.optim.Optimizer,
    data: TrainingData,
    accelerator: Accelerator,
    name: str,
    on_epoch: Callable[[LoopState], None] = lambda state: None,
    describe: Callable[[dict[str, Any]], str] = lambda stats: "",
) -> Generator[LoopState, None, Result]:
    """Train `module` for recipe.epochs, resuming from run_dir/checkpoints, one epoch at a
    time: yields the state after each epoch's checkpoint (`Epochs` says what `on_epoch` and
    `describe` do), returns the Result (`drain` runs it to its end). What lets a stack of
    runs (stages/train.py, `run_stack`) take their epochs in turn in one process, each
    exactly as it would alone."""
    dev = accelerator.device
    pixels = data.pixels or PixelSource(data.train.images, data.mixed and data.mixed.images)
    data = replace(
        data,
        mean=torch.as_tensor(data.mean, dtype=torch.float32, device=dev),
        std=torch.as_tensor(data.std, dtype=torch.float32, device=dev),
        pixels=pixels,
        channels_last=dev.type == "cuda" or is_channels_last(module),
    )
    module, optimizer = accelerator.prepare(module, optimizer)
    epochs = Epochs(recipe, module, optimizer, data, accelerator, name, on_epoch, describe)
    for _ in train_units(epochs, accelerator, run_dir, recipe.checkpoint_limit, recipe.resume):
        yield epochs.state
    return epochs.result()
