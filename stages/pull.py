"""pull: a published semix dataset on the Hub -> runs/<name>/mixed/, every shard verified.

    python -m pipeline pull --set repo=user/semix-digits [revision=v1] [name=digits-hub]
    make train MIXED=runs/semix-digits/mixed

The download lands in a hidden sibling folder and is renamed into place only after every
shard matched manifest.json (sha256, size, sample count), so a reader never sees a
half-downloaded or corrupt dataset under the real name. The repo's dataset card, which
publish uploads from memory, comes along as mixed/README.md.
"""

from __future__ import annotations

from pathlib import Path

from core.config import ConfigError
from core.logs import log
from shards import hub
from stages.configs.pull import Config


def run(cfg: Config) -> Path:
    # 1. Where it goes: runs/<name>/mixed, name defaulting to the repo's name part.
    if not cfg.repo:
        raise ConfigError(
            "pull needs repo=user/name: add it to this command's --set (make: REPO=user/name)"
        )
    dest = Path(cfg.out) / (cfg.name or cfg.repo.split("/")[-1]) / "mixed"
    # 2. Download, verify, move into place.
    manifest = hub.pull(cfg.repo, cfg.revision, dest, overwrite=cfg.overwrite)
    log.info(
        "pull %s%s: %d samples in %d shards verified -> %s",
        cfg.repo,
        f"@{cfg.revision}" if cfg.revision else "",
        manifest.num_samples,
        len(manifest.shards),
        dest,
    )
    return dest
