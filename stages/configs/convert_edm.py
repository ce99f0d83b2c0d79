"""Config of `convert-edm`: an EDM network pickle -> a safetensors + config folder (the edm backend)."""

from __future__ import annotations

from dataclasses import dataclass

from core.config import StageConfig
from stages.presets import stage_presets


@dataclass(frozen=True)
class Config(StageConfig):
    source: str = ""  # the EDM .pkl (e.g. edm-cifar10-32x32-cond-vp.pkl); read, never executed
    dest: str = ""  # "" = runs/<classes>/edm, where `generate --set backend=edm` looks first


PRESETS = stage_presets("convert-edm")  # converting is the same for every dataset
