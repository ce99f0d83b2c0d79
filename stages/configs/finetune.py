"""Config of the `finetune` stage: train/<run>/ -> runs/<classes>/finetune/<run>-<objective>/.

`objective` picks what the trained run is fine-tuned under: MaC-Cal (docs/methods.md §4: frozen
backbone, new masked bottleneck head, adaptive retention q) or a FeDLaS loss (docs/methods.md §5:
the whole trained model continues under the FeDLaS-LS / -MbLS objective train's `loss=` builds).
Each objective reads its own section: `maccal` (its length, lr, head width and its retention
schedule's parameters, derived from models/heads.RetentionParams: `maccal.q0`), or `fedlas`
(length, lr) and `loss`, the FeDLaS losses' parameters at train's paths
(`loss.fedlas_ls.alpha`, derived from the losses' own parameters); batch size, momentum, weight
decay and augmentation are shared. GUESS values of docs/methods.md are fields with the given
default. config.json keeps the flat names (`method` for `objective`, `maccal_q0`,
`fedlas_ls_alpha`: LEGACY), and the command line still takes them, saying the path once, and
the picked objective's shorthand (`objective.q0=0.7`, `objective.alpha=0.1`: the `OBJECTIVE`
section, core/parts.py; `method.q0=0.7`, its old name, says `method is now objective`).
The word `method` is the study's (pipeline/study/config.py): one arm of its comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from core.config import ConfigError, StageConfig, bounded, check_choice, check_range
from core.parts import Section
from core.precision import check_precision
from core.tracking import parse_trackers
from core.tree import section
from models.heads import MaCCalPart
from shards.datapath import Data
from stages.configs.legacy import legacy_names
from stages.configs.sections import Augment, Checkpoint
from stages.configs.train import LOSS, PRECISIONS
from stages.presets import stage_presets

# what `objective=` takes: stages/finetune.SETUPS sets each up
OBJECTIVES = ("maccal", "fedlas-ls", "fedlas-mbls")
# MaC-Cal's retention schedule (models/heads.py): leaves of the `maccal` section (`maccal.q0`)
RETENTION = Section("maccal", {"maccal": MaCCalPart()})
# the FeDLaS methods are train's losses of the same names: their parameters, at train's paths
FEDLAS = Section("loss", {m: LOSS.parts[m] for m in OBJECTIVES[1:]})
Loss = FEDLAS.tree("", __name__, pick=False)
Loss.__doc__ = "the FeDLaS losses' parameters, as train's (objective=fedlas-ls | fedlas-mbls)"


@dataclass(frozen=True)
class Optim:
    """SGD with momentum (docs/methods.md §4: momentum 0.9, wd 5e-4); each objective's own lr"""

    momentum: float = bounded(0.9, 0.0, 1.0, high_open=True)
    weight_decay: float = bounded(5e-4, 0.0)
    # grad-norm clip of the classifier only (not the gate); 0 = off
    clip_norm: float = bounded(2.0, 0.0)


@dataclass(frozen=True)
@RETENTION.within("maccal")  # then the retention schedule's parameters: maccal.q0, ...
class MaCCal:
    """MaC-Cal (docs/methods.md §4)"""

    epochs: int = bounded(40, 1)
    lr: float = bounded(0.1, 0.0, low_open=True)  # constant
    # bottleneck width r (GUESS); the retention schedule's parameters follow (models/heads.py)
    r: int = bounded(256, 1)


@dataclass(frozen=True)
class FeDLaS:
    """FeDLaS fine-tuning (docs/methods.md §5)"""

    epochs: int = bounded(10, 1)  # GUESS: docs/methods.md gives no fine-tuning length
    # constant; GUESS: the last lr of the CIFAR Stage-I recipe
    lr: float = bounded(0.001, 0.0, low_open=True)


# `objective.q0=0.7`, `objective.alpha=0.1`: the picked objective's parameter
# (core.config.parse_sets), spelt as its path (`maccal.q0`, `loss.fedlas_ls.alpha`); `method.q0`,
# the old name, is still taken
OBJECTIVE = Section.joined("objective", RETENTION, FEDLAS, formerly="method")


@dataclass(frozen=True)
class Config(StageConfig):
    # the folders under the runs root it names: plain names (core.config.check_plain_name)
    FOLDER_NAMES: ClassVar[tuple[str, ...]] = ("name", "run")
    LEGACY = legacy_names("finetune", OBJECTIVE.legacy)
    SECTIONS = (OBJECTIVE,)  # `objective.alpha=0.1`: the picked one's (core.config.parse_sets)

    run: str = ""  # the trained run: runs/<classes>/train/<run>/ (RUN=)
    objective: str = "maccal"  # maccal | fedlas-ls | fedlas-mbls (OBJECTIVE=)
    # shared recipe (docs/methods.md §4: batch 128, momentum 0.9, wd 5e-4)
    batch_size: int = 128
    optim: Optim = section(Optim)
    augment: Augment = section(Augment)
    maccal: MaCCal = section(MaCCal)
    fedlas: FeDLaS = section(FeDLaS)
    loss: Loss = section(Loss)
    data: Data = section(Data)  # how real/train and real/val are read
    # machinery
    precision: str = "auto"  # auto: bf16 where the device computes it natively, else fp32
    # images per validation pass on a GPU; a CPU's passes take at most 64 (models.training)
    eval_batch_size: int = 512
    checkpoint: Checkpoint = section(Checkpoint)  # one after every epoch
    # experiment tracking (core/tracking.py): none | tensorboard | wandb | mlflow | trackio, or
    # several (tensorboard,mlflow); not part of the run's identity
    tracker: str = "none"

    def __post_init__(self):
        if not self.run:
            raise ConfigError("set run=NAME (RUN=): the trained run under train/ to fine-tune")
        if "/" in self.run or self.run.startswith("."):
            raise ConfigError(f"run={self.run!r} must be a plain folder name")
        check_choice("objective", self.objective, OBJECTIVES)
        check_precision("precision", self.precision, PRECISIONS)
        check_range("batch_size", self.batch_size, 1)
        check_range("eval_batch_size", self.eval_batch_size, 1)
        parse_trackers(self.tracker)
        check_range("cpu_threads", self.cpu_threads, 0)

    @property
    def output(self) -> str:
        """Folder name under finetune/: <run>-<objective>."""
        return f"{self.run}-{self.objective}"

    @property
    def augments(self) -> bool:
        return self.augment.crop_pad > 0 or self.augment.flip

    @property
    def epochs(self) -> int:
        return self.maccal.epochs if self.objective == "maccal" else self.fedlas.epochs

    def objective_params(self) -> dict[str, Any]:
        """RetentionSchedule kwargs (maccal) or FeDLaSCriterion kwargs (fedlas-*)."""
        if self.objective == "maccal":
            return {p: getattr(self.maccal, p) for p in RETENTION.paths_of("maccal")}
        return self.loss.params(part=self.objective)


OBJECTIVE.default = Config.objective  # `objective.q0=` with none set names maccal's


PRESETS = stage_presets("finetune")
