"""Config of the `publish` stage: runs/<classes>/mixed/ -> a dataset repo on the Hugging Face Hub."""

from __future__ import annotations

import re
from dataclasses import dataclass

from core.config import ConfigError, StageConfig, check_choice
from shards.card import HUB_LICENSES
from stages.presets import stage_presets

# "namespace/name" as the Hub spells it: letters, digits, - _ . ; no "--" or "..".
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")


def check_repo(repo: str) -> None:
    """Empty is allowed here (so --fields/--print-config work); the stage insists on one."""
    if repo and (not _REPO_ID.match(repo) or "--" in repo or ".." in repo):
        raise ConfigError(f"repo={repo!r} is not a Hub repo id; write it as user/name")


@dataclass(frozen=True)
class Config(StageConfig):
    repo: str = ""  # user/name of the dataset repo (REPO=)
    private: bool = False  # create the repo private (PRIVATE=1)
    dry_run: bool = False  # print the upload plan and the card; no network, no file (DRY_RUN=1)
    license: str = ""  # Hub license id overriding the one derived from the generator
    overwrite: bool = False  # replace a repo that holds a different dataset
    mixed: str = ""  # the mixed/ folder; defaults to runs/<classes>/mixed (MIXED=)

    def __post_init__(self):
        check_repo(self.repo)
        if self.license:
            check_choice("license", self.license, HUB_LICENSES)


PRESETS = stage_presets("publish")  # publishing is the same for every dataset
