"""Config of the `pull` stage: a published dataset repo -> runs/<name>/mixed/, verified."""

from __future__ import annotations

from dataclasses import dataclass

from core.config import StageConfig
from stages.configs.publish import check_repo
from stages.presets import stage_presets


@dataclass(frozen=True)
class Config(StageConfig):
    repo: str = ""  # user/name of the dataset repo (REPO=); name= defaults to its name part
    revision: str = ""  # branch, tag or commit sha; empty = the default branch (REVISION=)
    overwrite: bool = False  # replace an existing runs/<name>/mixed/

    def __post_init__(self):
        check_repo(self.repo)


PRESETS = stage_presets("pull")  # pulling is the same for every dataset
