"""Config of the `shift` stage: real/test -> runs/<classes>/shift/test-c/ (CIFAR-C layout).

Identity (a rerun with other values is refused, docs/shift.md): `corruptions`, `limit`, `seed`,
the preset. Where the root lives (`out`, `name`) is not.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import ConfigError, StageConfig, check_range
from models.corruptions import CORRUPTIONS
from stages.presets import stage_presets


@dataclass(frozen=True)
class Config(StageConfig):
    # which corruptions, in this order (each one <name>.npy: 5 severities x N); docs/shift.md
    corruptions: tuple[str, ...] = tuple(CORRUPTIONS)
    # the first `limit` test images (test-split order; 0 = all): the study's robustness table
    # reads 2,000 (x 5 severities x 11 corruptions), keeping its cost and its stored logits small
    limit: int = 0

    def __post_init__(self):
        unknown = [c for c in self.corruptions if c not in CORRUPTIONS]
        if unknown:
            raise ConfigError(
                f"corruptions: unknown {', '.join(map(repr, unknown))}; choose from: "
                f"{', '.join(CORRUPTIONS)}"
            )
        if not self.corruptions:
            raise ConfigError("corruptions: name at least one corruption")
        check_range("limit", self.limit, 0)
        if len(set(self.corruptions)) != len(self.corruptions):
            raise ConfigError(f"corruptions: a name is repeated in {','.join(self.corruptions)}")


PRESETS = stage_presets("shift")  # the split's manifest says the image size and channels
