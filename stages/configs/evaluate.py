"""Config of the `evaluate` stage: trained runs -> eval/<stage>/<run>/ and eval/report.md.

Identity of an evaluation (a rerun with the same values skips it): the upstream digests and
`ts_criterion`. `batch_size`, `device` and the data path fields (stages/common/data.py) say how it is
computed, not what: they are not compared; `internal_runs` says which runs to evaluate and
report, not how.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from core.config import ConfigError, StageConfig, check_choice, check_range
from core.tree import section
from models.calibration import TS_CRITERIA
from shards.datapath import Data
from stages.configs.legacy import legacy_names
from stages.presets import stage_presets

STAGE_DIRS = ("", "train", "finetune")  # "": look in train/ first, then finetune/


@dataclass(frozen=True)
class Config(StageConfig):
    # the folders under the runs root it names: plain names (core.config.check_plain_name)
    FOLDER_NAMES: ClassVar[tuple[str, ...]] = ("name", "run", "runs", "ensemble_name")
    LEGACY = legacy_names("evaluate")

    run: str = ""  # one run (RUN=name); with neither run nor runs: every user run, one by one
    runs: tuple[str, ...] = ()  # several runs (RUNS=a,b,c): each one, plus their deep ensemble
    stage_dir: str = ""  # pin where runs live: train | finetune
    ensemble_name: str = (
        ""  # folder under runs/<classes>/eval/ensemble/; "" = members joined by "+"
    )
    # OOD sets (OOD=a,b): each a prepared split folder, real/ root or runs/<name>/ root, e.g. the
    # `ood` stage's runs/<classes>/ood/<set>; scored against real/test (AUROC, FPR95, AUPR)
    ood: tuple[str, ...] = ()
    corruptions: str = ""  # CIFAR-C layout: <corruption>.npy (5 severities x N) + labels.npy
    # temperature scaling: "nll" minimises val NLL (Guo et al. 2017); "ece" = lowest val ECE
    # on the grid 0.1..10 (the focal-calibration code)
    ts_criterion: str = "nll"
    # the runs a chain or a study trains for its own use (annotate's encoder, the fidelity
    # judges, the study's tune-* runs) are neither evaluated by a bare `make evaluate` nor listed
    # in eval/report.md; true includes them (stages/evaluate/__init__.py, internal_runs)
    internal_runs: bool = False
    batch_size: int = 512
    device: str = ""  # "" = cuda if available, else cpu
    data: Data = section(Data)  # how test/val (and the OOD set) are read

    def __post_init__(self):
        check_choice("stage_dir", self.stage_dir, STAGE_DIRS)
        check_choice("ts_criterion", self.ts_criterion, TS_CRITERIA)
        check_range("batch_size", self.batch_size, 1)
        for name in self.run_names():
            if not name or "/" in name or name.startswith("."):
                raise ConfigError(f"run name {name!r} must be a plain folder name")
        if "/" in self.ensemble_name or self.ensemble_name.startswith("."):
            raise ConfigError(f"ensemble_name={self.ensemble_name!r} must be a plain folder name")

    def run_names(self) -> list[str]:
        """`run` then `runs`, without repeats."""
        return list(dict.fromkeys([*([self.run] if self.run else []), *self.runs]))


PRESETS = stage_presets("evaluate")  # evaluation is the same for every dataset
