"""Config of the `train` stage: real/ (+ mixed/) -> runs/<classes>/train/<run>/.

One `loss` field picks the objective (models/objectives.OBJECTIVES). Each loss's parameters are
its own frozen dataclass; the `LOSS` section (core/parts.py) derives a field per parameter from
them, `<loss>_<param>` as config.json has always recorded it, so `--set loss=focal focal_gamma=2`
and `--set loss.name=focal loss.gamma=2` do the same thing, and a loss registered from outside
(pipeline/plugins.py) gets its fields with no edit here.
The defaults are the CSM reference recipe (docs/methods.md §3: ResNet-50, SGD 0.1, momentum 0.9, wd 5e-4,
batch 128, 200 epochs, lr ÷10 at 80 and 120, clip 2, crop(pad 4) + flip); each preset's own
recipe is in stages/presets/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.config import ConfigError, StageConfig, check_choice, check_range, not_recorded
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
LOSS = Section("loss", OBJECTIVES, heading="loss parameters (docs/methods.md §5-6)")
# loss -> {objective parameter: config field}, derived (csm's sharpening and targets are the
# stage's: how it loads mixed/)
LOSS_FIELDS: dict[str, dict[str, str]] = {n: LOSS.fields_of(n, data=False) for n in LOSS.names}
# the classifier loop's precisions (core/precision.py): no fp16, whose gradients need a scaler
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass(frozen=True)
class Optim:
    """SGD with momentum; the lr times lr_gamma at each milestone epoch"""

    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    milestones: tuple[int, ...] = (80, 120)
    lr_gamma: float = 0.1
    clip_norm: float = 2.0  # gradient-norm clip of the classifier's parameters; 0 = off

    def __post_init__(self) -> None:
        check_range("optim.lr", self.lr, 0.0)
        check_range("optim.clip_norm", self.clip_norm, 0.0)
        if list(self.milestones) != sorted(self.milestones):
            raise ConfigError(f"optim.milestones={list(self.milestones)} must be increasing")


@dataclass(frozen=True)
@LOSS.fields(after="loss")  # every loss's parameters, one field each, after `loss`
class Config(StageConfig):
    LEGACY = legacy_names("train")

    run: str = ""  # run folder: runs/<classes>/train/<run>/; "" = the loss (loss=focal: focal)
    loss: str = "ce"  # the objective; its parameters: its fields below, or loss.<param>=value
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
        check_choice("loss", self.loss, LOSS.names)
        if not self.model.startswith(TIMM_PREFIX):
            check_choice("model", self.model, (*CLASSIFIERS, f"{TIMM_PREFIX}<name>"))
        elif not _timm_has(self.model.removeprefix(TIMM_PREFIX)):
            raise ConfigError(f"model={self.model!r}: timm has no such model (timm.list_models())")
        if not self.run or "/" in self.run or self.run.startswith("."):
            raise ConfigError(f"run={self.run!r} must be a plain folder name")
        check_choice("in_channels", self.in_channels, (1, 3))
        LOSS.check(self)  # every loss's parameters, as their dataclasses declare
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
        return {**values, "run": values.get("loss", cls.__dataclass_fields__["loss"].default)}

    def loss_params(self) -> dict[str, Any]:
        """The objective's keyword arguments for `loss`, read from its fields."""
        return LOSS.params(self)


def _timm_has(name: str) -> bool:
    import timm  # only when a timm model is asked for: importing timm takes a second

    return bool(timm.is_model(name))


PRESETS = stage_presets("train")
