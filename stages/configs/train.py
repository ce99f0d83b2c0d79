"""Config of the `train` stage: real/ (+ mixed/) -> runs/<classes>/train/<run>/.

One `loss` field picks the objective (models/training.OBJECTIVES); each loss reads its own
parameter fields (LOSS_FIELDS), so `--set loss=focal focal_gamma=2` does what it says.
The defaults are the CSM reference recipe (METHODS §3: ResNet-50, SGD 0.1, momentum 0.9, wd 5e-4,
batch 128, 200 epochs, lr ÷10 at 80 and 120, clip 2, crop(pad 4) + flip); each preset's own
recipe is in stages/presets/.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from core.config import ConfigError, StageConfig, check_choice, check_range
from core.tracking import parse_trackers
from models.classifiers import CLASSIFIERS, TIMM_PREFIX
from models.losses import MMCE_NORMALIZATIONS
from models.objectives import MIXED_LOSSES
from shards.datapath import (
    DEFAULT_DATA_PATH,
    DEFAULT_MEMORY_BUDGET_GB,
    DEFAULT_STREAM_PREFETCH,
    DEFAULT_STREAM_WORKERS,
    check_data_fields,
)
from stages.presets import stage_presets

# loss -> {objective parameter: config field}
LOSS_FIELDS: dict[str, dict[str, str]] = {
    "ce": {},
    "ls": {"alpha": "ls_alpha"},
    "focal": {"gamma": "focal_gamma"},
    "flsd53": {"gamma_below": "flsd_gamma_below", "gamma": "flsd_gamma"},
    "mbls": {"m": "mbls_margin", "lam": "mbls_lam"},
    "mmce": {"lam": "mmce_lam"},
    "mmce_weighted": {"lam": "mmce_lam", "normalization": "mmce_normalization"},
    "mixup": {"alpha": "mixup_alpha"},
    "csm": {"weight": "csm_weight", "mixed_loss": "csm_mixed_loss"},
    "fedlas-ls": {"alpha": "fedlas_ls_alpha", "beta": "fedlas_ls_beta", "theta": "fedlas_theta"},
    "fedlas-mbls": {
        "alpha": "fedlas_mbls_alpha",
        "beta": "fedlas_mbls_beta",
        "theta": "fedlas_theta",
        "margin": "fedlas_margin",
    },
}
PRECISIONS = ("auto", "fp32", "bf16")  # auto: bf16 on GPU, fp32 on CPU
# FeDLaS's defaults: METHODS §5's CIFAR-10 values (the presets give the other datasets' theirs)
FEDLAS_LS = {"alpha": 0.05, "beta": 4.0, "theta": 0.95}
FEDLAS_MBLS = {"alpha": 0.1, "beta": 0.5, "theta": 0.95, "margin": 6.0}
# fields left out of config.json: how to continue, not what to train
NOT_RECORDED = ("resume",)
# fields added after runs were published: config.json holds them only off their default, so a
# run at the default keeps its config.json bytes and an existing run folder still matches
RECORDED_OFF_DEFAULT = ("mmce_normalization",)


@dataclass(frozen=True)
class Config(StageConfig):
    run: str = ""  # run folder: runs/<classes>/train/<run>/; "" = the loss (loss=focal: focal)
    loss: str = "ce"
    model: str = "resnet50"  # models.classifiers name or timm:<name>
    pretrained: bool = False  # timm models only
    in_channels: int = 3  # 1 = grey (channel mean of the RGB image)
    # recipe (METHODS §3)
    epochs: int = 200
    batch_size: int = 128  # global, split over processes
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    milestones: tuple[int, ...] = (80, 120)
    lr_gamma: float = 0.1
    clip_norm: float = 2.0  # gradient-norm clip of the classifier's parameters; 0 = off
    crop_pad: int = 4  # random crop after zero padding; 0 = off
    flip: bool = True  # random horizontal flip
    # loss parameters (METHODS §5-6)
    ls_alpha: float = 0.05
    focal_gamma: float = 3.0
    flsd_gamma_below: float = 5.0  # FLSD-53: γ where p_y < 0.2
    flsd_gamma: float = 3.0
    mbls_margin: float = 6.0
    mbls_lam: float = 0.1
    mmce_lam: float = 2.0
    # mmce_weighted's pair-sum normalisation: paper (Kumar et al.) | focal_calibration (the
    # torrvision/focal_calibration code later baselines use; docs/train.md)
    mmce_normalization: str = "paper"
    mixup_alpha: float = 1.0  # Beta(α, α); GUESS (Zhang et al.'s CIFAR value)
    csm_weight: float = 1.0  # w of the synthetic term (reference: 1)
    csm_sharpening: float = 0.0  # s > 0: t_a = sigmoid(s(λ̂ − 0.5)) at load; 0: the stored soft
    # the paper's ablations: targets "ratio" = t_a = α (no re-annotation); mixed loss "ce" =
    # soft-target cross-entropy instead of L2
    csm_targets: str = "soft"  # soft | ratio
    csm_mixed_loss: str = "l2"  # l2 | ce
    fedlas_ls_alpha: float = FEDLAS_LS["alpha"]
    fedlas_ls_beta: float = FEDLAS_LS["beta"]
    fedlas_mbls_alpha: float = FEDLAS_MBLS["alpha"]
    fedlas_mbls_beta: float = FEDLAS_MBLS["beta"]
    fedlas_margin: float = FEDLAS_MBLS["margin"]
    fedlas_theta: float = FEDLAS_LS["theta"]
    # data
    mixed: str = ""  # mixed folder for loss=csm; "" = runs/<classes>/mixed
    train_limit: int = 0  # use only the first N training images (smoke tests); 0 = all
    # how the images are read (stages/data.py); not part of the run's identity
    data_path: str = DEFAULT_DATA_PATH  # auto | memory | stream
    memory_budget_gb: float = DEFAULT_MEMORY_BUDGET_GB  # auto's budget; 0 = from free memory
    stream_workers: int = DEFAULT_STREAM_WORKERS  # DataLoader workers per process (stream)
    stream_prefetch: int = DEFAULT_STREAM_PREFETCH  # steps each worker decodes ahead
    # machinery
    precision: str = "auto"
    checkpoint_limit: int = 2  # complete checkpoints kept (a save never touches the older ones)
    resume: str = "auto"  # auto | latest | "" (start over) | <checkpoint folder>
    eval_batch_size: int = 512
    # experiment tracking (core/tracking.py): none | tensorboard | wandb | mlflow | trackio, or
    # several (tensorboard,mlflow); not part of the run's identity
    tracker: str = "none"

    def __post_init__(self):
        check_choice("loss", self.loss, tuple(LOSS_FIELDS))
        if not self.run:  # named after its loss, so `loss=focal` never lands in another loss's run
            object.__setattr__(self, "run", self.loss)
        if not self.model.startswith(TIMM_PREFIX):
            check_choice("model", self.model, (*CLASSIFIERS, f"{TIMM_PREFIX}<name>"))
        elif not _timm_has(self.model.removeprefix(TIMM_PREFIX)):
            raise ConfigError(f"model={self.model!r}: timm has no such model (timm.list_models())")
        if not self.run or "/" in self.run or self.run.startswith("."):
            raise ConfigError(f"run={self.run!r} must be a plain folder name")
        check_choice("in_channels", self.in_channels, (1, 3))
        check_choice("csm_targets", self.csm_targets, ("soft", "ratio"))
        check_choice("csm_mixed_loss", self.csm_mixed_loss, MIXED_LOSSES)
        check_choice("mmce_normalization", self.mmce_normalization, MMCE_NORMALIZATIONS)
        check_choice("precision", self.precision, PRECISIONS)
        for name in ("epochs", "batch_size", "eval_batch_size"):
            check_range(name, getattr(self, name), 1)
        check_range("checkpoint_limit", self.checkpoint_limit, 1)
        check_range("lr", self.lr, 0.0)
        check_range("crop_pad", self.crop_pad, 0)
        check_range("clip_norm", self.clip_norm, 0.0)
        check_range("csm_weight", self.csm_weight, 0.0)
        check_range("csm_sharpening", self.csm_sharpening, 0.0)
        check_range("train_limit", self.train_limit, 0)
        check_data_fields(self)
        parse_trackers(self.tracker)
        check_range("cpu_threads", self.cpu_threads, 0)
        if list(self.milestones) != sorted(self.milestones):
            raise ConfigError(f"milestones={list(self.milestones)} must be increasing")

    def loss_params(self) -> dict[str, Any]:
        """The objective's keyword arguments for `loss`, read from its fields."""
        return {param: getattr(self, field) for param, field in LOSS_FIELDS[self.loss].items()}

    def record(self) -> dict[str, Any]:
        """What config.json holds (everything but how to continue; RECORDED_OFF_DEFAULT fields
        only off their default)."""
        default = {f.name: f.default for f in fields(self) if f.name in RECORDED_OFF_DEFAULT}
        return {
            k: v
            for k, v in self.to_dict().items()
            if k not in NOT_RECORDED and not (k in default and v == default[k])
        }


def _timm_has(name: str) -> bool:
    import timm  # only when a timm model is asked for: importing timm takes a second

    return bool(timm.is_model(name))


PRESETS = stage_presets("train")
