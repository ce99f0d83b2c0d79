"""Config of the `train` stage: real/ (+ mixed/) -> runs/<classes>/train/<run>/.

The `loss` section picks the objective (models/objectives.OBJECTIVES) and holds every loss's
parameters, derived from each loss's own frozen dataclass by the `LOSS` section (core/parts.py):
`cfg.loss.name`, `cfg.loss.focal.gamma`. So `--set loss=focal loss.gamma=2`,
`loss.focal.gamma=2` and the flat `focal_gamma=2` (config.json's name, saying its path once) do
the same thing, and a loss registered from outside (pipeline/plugins.py) gets its leaves with no
edit here.
The defaults are the CSM reference recipe (docs/methods.md §3: ResNet-50, SGD 0.1, momentum 0.9, wd 5e-4,
batch 128, 200 epochs, lr ÷10 at 80 and 120, clip 2, crop(pad 4) + flip); each preset's own
recipe is in stages/presets/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from core.config import (
    ConfigError,
    StageConfig,
    bounded,
    check_choice,
    check_range,
    not_recorded,
)
from core.parts import Section
from core.precision import check_precision
from core.tracking import parse_trackers
from core.tree import section
from models.classifiers import CLASSIFIERS, TIMM_PREFIX
from models.objectives import OBJECTIVES
from shards.datapath import Data
from stages.configs.legacy import legacy_names
from stages.configs.sections import Augment, Checkpoint
from stages.presets import stage_presets

# the losses (the registry as any plugin left it) and their parameters
LOSS = Section(
    "loss", OBJECTIVES, heading="the objective and its parameters (docs/methods.md §3-6)"
)
# the config's `loss` section; its parameters' flat names join the stage's LEGACY
Loss = LOSS.tree("ce", __name__, doc="the objective; its parameters: loss.<param>=value")
# the classifier loop's precisions (core/precision.py): no fp16, whose gradients need a scaler
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass(frozen=True)
class Optim:
    """SGD with momentum; the lr times lr_gamma at each milestone epoch"""

    lr: float = bounded(0.1, 0.0, low_open=True)
    momentum: float = bounded(0.9, 0.0, 1.0, high_open=True)
    weight_decay: float = bounded(5e-4, 0.0)
    milestones: tuple[int, ...] = (80, 120)
    lr_gamma: float = bounded(0.1, 0.0, low_open=True)
    # gradient-norm clip of the classifier's parameters; 0 = off
    clip_norm: float = bounded(2.0, 0.0)

    def __post_init__(self) -> None:
        if list(self.milestones) != sorted(self.milestones):
            raise ConfigError(f"optim.milestones={list(self.milestones)} must be increasing")


@dataclass(frozen=True)
class Config(StageConfig):
    # the folders under the runs root it names: plain names (core.config.check_plain_name)
    FOLDER_NAMES: ClassVar[tuple[str, ...]] = ("name", "run")
    LEGACY = legacy_names("train", LOSS.legacy)
    SECTIONS = (LOSS,)  # `loss.gamma=2`: the picked loss's (core.config.parse_sets)

    run: str = ""  # run folder: runs/<classes>/train/<run>/; "" = the loss (loss=focal: focal)
    loss: Loss = section(Loss)
    model: str = "resnet50"  # models.classifiers name or timm:<name>
    pretrained: bool = False  # timm models only
    in_channels: int = 3  # 1 = grey (channel mean of the RGB image)
    # recipe (docs/methods.md §3)
    epochs: int = 200
    batch_size: int = 128  # global, split over processes
    optim: Optim = section(Optim)
    augment: Augment = section(Augment)
    # what it trains on
    mixed: str = ""  # mixed folder for loss=csm; "" = runs/<classes>/mixed
    train_limit: int = 0  # use only the first N training images (smoke tests); 0 = all
    data: Data = section(Data)
    # machinery
    precision: str = "auto"  # auto: bf16 where the device computes it natively, else fp32
    checkpoint: Checkpoint = section(Checkpoint)
    # several seeds at once: train runs <run>-s<seed> of these seeds together in one process
    # (a stack: docs/train.md); each run's config.json is its plain run's, so not recorded
    seeds: tuple[int, ...] = not_recorded(())
    # images per validation pass on a GPU; a CPU's passes take at most 64 (models.training)
    eval_batch_size: int = 512
    # experiment tracking (core/tracking.py): none | tensorboard | wandb | mlflow | trackio, or
    # several (tensorboard,mlflow); not part of the run's identity
    tracker: str = "none"

    def __post_init__(self):
        if not self.model.startswith(TIMM_PREFIX):
            check_choice("model", self.model, (*CLASSIFIERS, f"{TIMM_PREFIX}<name>"))
        elif not _timm_has(self.model.removeprefix(TIMM_PREFIX)):
            raise ConfigError(f"model={self.model!r}: timm has no such model (timm.list_models())")
        if not self.run or "/" in self.run or self.run.startswith("."):
            raise ConfigError(f"run={self.run!r} must be a plain folder name")
        check_choice("in_channels", self.in_channels, (1, 3))
        check_precision("precision", self.precision, PRECISIONS)
        for name in ("epochs", "batch_size", "eval_batch_size"):
            check_range(name, getattr(self, name), 1)
        check_range("train_limit", self.train_limit, 0)
        parse_trackers(self.tracker)
        check_range("cpu_threads", self.cpu_threads, 0)
        if len(set(self.seeds)) != len(self.seeds) or any(s < 0 for s in self.seeds):
            raise ConfigError(f"seeds={list(self.seeds)} must be distinct seeds >= 0")

    @classmethod
    def fill_defaults(cls, values: dict[str, Any]) -> dict[str, Any]:
        """run="" -> the loss's name, so `loss=focal` never lands in another loss's run (core.
        config.resolve calls this before building the frozen config)."""
        if values.get("run"):
            return values
        loss = values.get("loss.name", values.get("loss", LOSS.default))
        return {**values, "run": getattr(loss, "name", loss)}


def _timm_has(name: str) -> bool:
    import timm  # only when a timm model is asked for: importing timm takes a second

    return bool(timm.is_model(name))


PRESETS = stage_presets("train")
