"""Config of the `finetune` stage: train/<run>/ -> runs/<classes>/finetune/<run>-<method>/.

`method` picks MaC-Cal (METHODS §4: frozen backbone, new masked bottleneck head, adaptive
retention q) or FeDLaS fine-tuning (METHODS §5: the whole trained model continues under the
FeDLaS-LS / -MbLS loss). Each method reads its own prefixed fields (`maccal_*`, `fedlas_*`);
batch size, momentum, weight decay and augmentation are shared. GUESS values of METHODS are
fields with the given default. The FeDLaS fields are those of train's fedlas-* losses, derived
from their parameters (the `FEDLAS` section, core/parts.py: also `method.alpha=0.1`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.config import ConfigError, StageConfig, check_choice, check_range, not_recorded
from core.parts import Section
from core.tracking import parse_trackers
from shards.datapath import (
    DEFAULT_DATA_PATH,
    DEFAULT_MEMORY_BUDGET_GB,
    DEFAULT_STREAM_PREFETCH,
    DEFAULT_STREAM_WORKERS,
    check_data_fields,
)
from stages.configs.train import LOSS, PRECISIONS
from stages.presets import stage_presets

METHODS = ("maccal", "fedlas-ls", "fedlas-mbls")
# the FeDLaS methods are train's losses of the same names: their parameters, the same fields
FEDLAS = Section("method", {m: LOSS.parts[m] for m in METHODS[1:]})
# method -> {FeDLaSCriterion parameter: config field}
FEDLAS_FIELDS: dict[str, dict[str, str]] = {m: FEDLAS.fields_of(m) for m in FEDLAS.names}
MACCAL_FIELDS = {
    "q0": "maccal_q0",
    "gamma": "maccal_gamma",
    "tau0": "maccal_tau0",
    "lam": "maccal_lam",
    "q_min": "maccal_q_min",
    "q_max": "maccal_q_max",
}


@dataclass(frozen=True)
@FEDLAS.fields(after="clip_norm")  # the FeDLaS losses' parameters, one field each
class Config(StageConfig):
    run: str = ""  # the trained run: runs/<classes>/train/<run>/ (RUN=)
    method: str = "maccal"  # maccal | fedlas-ls | fedlas-mbls (METHOD=)
    # shared recipe (METHODS §4: batch 128, momentum 0.9, wd 5e-4)
    batch_size: int = 128
    momentum: float = 0.9
    weight_decay: float = 5e-4
    crop_pad: int = 4  # random crop after zero padding; crop_pad=0 and flip=false: no augmentation
    flip: bool = True
    # MaC-Cal (METHODS §4)
    maccal_epochs: int = 40
    maccal_lr: float = 0.1  # constant
    maccal_r: int = 256  # bottleneck width r (GUESS)
    maccal_q0: float = 0.9  # GUESS defaults of the retention schedule
    maccal_gamma: float = 0.9
    maccal_tau0: float = 0.1
    maccal_lam: float = 5.0
    maccal_q_min: float = 0.3
    maccal_q_max: float = 1.0
    # FeDLaS fine-tuning (METHODS §5)
    fedlas_epochs: int = 10  # GUESS: METHODS gives no fine-tuning length
    fedlas_lr: float = 0.001  # constant; GUESS: the last lr of the CIFAR Stage-I recipe
    clip_norm: float = 2.0  # grad-norm clip of the classifier only (not the gate); 0 = off
    # how real/train and real/val are read (stages/data.py); not part of the run's identity
    data_path: str = DEFAULT_DATA_PATH  # auto | memory | stream
    memory_budget_gb: float = DEFAULT_MEMORY_BUDGET_GB  # auto's budget; 0 = from free memory
    stream_workers: int = DEFAULT_STREAM_WORKERS  # DataLoader workers per process (stream)
    stream_prefetch: int = DEFAULT_STREAM_PREFETCH  # steps each worker decodes ahead
    # machinery
    precision: str = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU
    eval_batch_size: int = 512
    checkpoint_limit: int = 2  # complete checkpoints kept (one after every epoch)
    # auto | latest | "" (start over) | <checkpoint folder>; how to continue, not what to tune
    resume: str = not_recorded("auto")
    # experiment tracking (core/tracking.py): none | tensorboard | wandb | mlflow | trackio, or
    # several (tensorboard,mlflow); not part of the run's identity
    tracker: str = "none"

    def __post_init__(self):
        if not self.run:
            raise ConfigError("set run=NAME (RUN=): the trained run under train/ to fine-tune")
        if "/" in self.run or self.run.startswith("."):
            raise ConfigError(f"run={self.run!r} must be a plain folder name")
        check_choice("method", self.method, METHODS)
        FEDLAS.check(self)
        check_choice("precision", self.precision, PRECISIONS)
        for name in ("batch_size", "maccal_epochs", "maccal_r", "fedlas_epochs"):
            check_range(name, getattr(self, name), 1)
        check_range("eval_batch_size", self.eval_batch_size, 1)
        check_data_fields(self)
        parse_trackers(self.tracker)
        check_range("checkpoint_limit", self.checkpoint_limit, 1)
        for name in ("maccal_lr", "fedlas_lr", "momentum", "weight_decay", "clip_norm"):
            check_range(name, getattr(self, name), 0.0)
        for name in ("crop_pad", "cpu_threads", "maccal_tau0", "maccal_lam"):
            check_range(name, getattr(self, name), 0)
        if not 0.0 <= self.maccal_q_min <= self.maccal_q0 <= self.maccal_q_max <= 1.0:
            raise ConfigError(
                "need 0 <= maccal_q_min <= maccal_q0 <= maccal_q_max <= 1, got "
                f"{self.maccal_q_min}, {self.maccal_q0}, {self.maccal_q_max}"
            )

    @property
    def output(self) -> str:
        """Folder name under finetune/: <run>-<method>."""
        return f"{self.run}-{self.method}"

    @property
    def augments(self) -> bool:
        return self.crop_pad > 0 or self.flip

    @property
    def epochs(self) -> int:
        return self.maccal_epochs if self.method == "maccal" else self.fedlas_epochs

    def method_params(self) -> dict[str, Any]:
        """RetentionSchedule kwargs (maccal) or FeDLaSCriterion kwargs (fedlas-*)."""
        fields = MACCAL_FIELDS if self.method == "maccal" else FEDLAS_FIELDS[self.method]
        return {param: getattr(self, field) for param, field in fields.items()}


PRESETS = stage_presets("finetune")
