"""The sections several stages' configs share (core/tree.py): how checkpoints are kept, how the
images are augmented (how they are read: shards.datapath.Data). A stage's own sections sit in its config module."""

from __future__ import annotations

from dataclasses import dataclass

from core.config import check_range, not_recorded


@dataclass(frozen=True)
class Checkpoint:
    """how many checkpoints are kept and how a run continues"""

    limit: int = 2  # complete checkpoints kept (a save never touches the older ones)
    # auto (newest complete, if any) | latest (must exist) | "" (start over) | a checkpoint
    # folder; how to continue, not what to train
    resume: str = not_recorded("auto")

    def __post_init__(self) -> None:
        check_range("checkpoint.limit", self.limit, 1)


@dataclass(frozen=True)
class Augment:
    """training augmentation; augment.crop_pad=0 and augment.flip=false: none"""

    crop_pad: int = 4  # random crop after zero padding; 0 = off
    flip: bool = True  # random horizontal flip

    def __post_init__(self) -> None:
        check_range("augment.crop_pad", self.crop_pad, 0)
