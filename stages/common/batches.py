"""What the classifier's epochs (stages/common/epochs.py) read, and each step's batch: the
`Recipe` (how to train), the `TrainingData` (real/train and real/val, the mixed series for CSM,
the pixels' source) and, per step, the planned global batch (`plan_steps`) and this process's
rows of it, augmented and prepared (`make_batch`).

The whole global batch is augmented and prepared (the objective's `prepare`: mixup) before each
process keeps its rows rank::world, so a step's rows do not depend on the number of processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from models.training import (
    SeriesIndex,
    csm_targets,
    normalize,
    random_crop_flip,
    sample_csm_members,
)
from shards.datasets import RealSplit
from shards.prefetch import PixelSource, StepPlan
from shards.store import SeriesImages

PAIRED = ("x_syn", "t_syn")  # batch entries with two rows per real image (CSM)


@dataclass(frozen=True)
class Recipe:
    """How to train, in the loop's terms; each stage fills it from its config."""

    key: tuple[Any, ...]  # every draw derives from (*key, "epoch", e, purpose)
    epochs: int
    batch_size: int  # global, split over processes
    lr: Callable[[int], float]  # lr of epoch e
    clip_norm: float = 0.0  # over objective.clip_parameters(model); 0 = off
    crop_pad: int = 0
    flip: bool = False
    keep: str = "best"  # best: highest val acc (first wins ties); last: the last epoch's
    eval_batch_size: int = 512
    checkpoint_limit: int = 2
    resume: str = "auto"  # shards.checkpoints.RESUME_HELP
    lr_field: str = "lr"  # the config field the lr comes from, as --set spells it (`optim.lr`)


@dataclass
class Mixed:
    """The series table on the device, with the targets CSM trains on (docs/methods.md §3)."""

    images: Tensor | SeriesImages  # uint8 [S, K, H, W, 3] (stream path: decoded when indexed)
    classes: Tensor  # [S, 2] (k-way: [S, k])
    soft: Tensor  # t_a [S, K] (k-way: t over the tuple [S, K, k])
    index: SeriesIndex
    interior: Tensor | None = None  # k-way: positions mixing >= 2 classes


@dataclass
class TrainingData:
    """What a step and validation read; mean/std: the run's normalisation.

    Labels and series fields are on the device; pixels come from `pixels` (stages/common/data.py:
    device tensors, or shards decoded ahead by DataLoader workers). Without one, `fit_epochs`
    indexes train.images (and mixed.images) as device tensors."""

    train: RealSplit
    val: RealSplit
    mean: list[float] | Tensor  # `fit_epochs` makes them tensors on the device (no copy per step)
    std: list[float] | Tensor
    image_size: int
    mixed: Mixed | None = None
    pixels: PixelSource | None = None
    channels_last: bool = False  # the model's layout: `fit_epochs` sets it, the batches follow it


def plan_steps(data: TrainingData, batches: list[Tensor], extra: torch.Generator) -> list[StepPlan]:
    """What each step of an epoch reads: its global batch of real/train samples and, for CSM,
    each real image's two series members (docs/methods.md §3: a random complete series containing
    its label, that series' best member for the label + a random interior one). Planned for
    the whole epoch first, so the streaming path can decode ahead; `extra` draws the members
    of step 1, 2, ... in turn, then serves the objectives' `prepare` (no objective uses both)."""
    mixed = data.mixed
    if mixed is None:
        return [StepPlan(idx) for idx in batches]
    plans = []
    for idx in batches:
        y = data.train.labels[idx]
        series, pos = sample_csm_members(
            y, mixed.index, mixed.soft, extra, check=False, interior=mixed.interior
        )
        plans.append(StepPlan(idx, series, pos))
    return plans


def make_batch(
    recipe: Recipe,
    data: TrainingData,
    plan: StepPlan,
    pixels: Any,
    augment: torch.Generator,
    extra: torch.Generator,
    objective: Any,
    rank: int,
    world: int,
) -> dict[str, Any]:
    """This process's rows of the planned global batch, augmented and prepared as a whole first
    (see the module docstring). `pixels` (shards.prefetch.Pixels): the plan's uint8 images,
    real [B, ...] and for CSM syn [2B, ...]."""
    idx, mixed = plan.idx, data.mixed
    mean, std = data.mean, data.std

    def norm(images: Tensor) -> Tensor:
        return normalize(images, mean, std, data.image_size, channels_last=data.channels_last)

    y = data.train.labels[idx]
    images = random_crop_flip(pixels.real, augment, recipe.crop_pad, recipe.flip)
    batch: dict[str, Any] = {"idx": idx, "x": norm(images), "y": y}
    if mixed is not None and plan.series is not None:
        series, pos = plan.series, plan.pos
        syn = random_crop_flip(pixels.syn, augment, recipe.crop_pad, recipe.flip)
        batch["x_syn"] = norm(syn)
        batch["t_syn"] = csm_targets(
            mixed.classes[series].flatten(0, 1),
            mixed.soft[series, pos].flatten(0, 1),
            mixed.index.num_classes,
        )
    batch = objective.prepare(batch, extra)
    if world == 1:
        return batch
    mine = torch.arange(rank, len(y), world, device=idx.device)
    pairs = torch.stack([2 * mine, 2 * mine + 1], dim=1).flatten()
    per_sample = {k: v for k, v in batch.items() if isinstance(v, Tensor) and v.ndim > 0}
    return batch | {k: v[pairs] if k in PAIRED else v[mine] for k, v in per_sample.items()}
