"""Config of the `ood` stage: far-OOD test sets shaped like real/test -> runs/<classes>/ood/<set>/.

Identity of a set's folder (a rerun with other values is refused, docs/shift.md): the set, `seed`
and `noise_images` (the synthetic sets), `shard_size`, the preset. `sets` only picks which
folders to build.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import ConfigError, StageConfig, check_range, not_recorded
from stages.presets import FAR_OOD_SETS, stage_presets

# the real images of a preset (stages/presets FAR_OOD_SETS: scikit-learn's 1,797 real handwritten
# digits) resized to the root's image size; uniform, gaussian: i.i.d. pixel noise (docs/shift.md)
SETS = (*FAR_OOD_SETS, "uniform", "gaussian")


@dataclass(frozen=True)
class Config(StageConfig):
    # which sets to build; empty = every set that is out-of-distribution for this root (all but
    # digits on a digits root)
    sets: tuple[str, ...] = not_recorded(())
    noise_images: int = 0  # images per synthetic set; 0 = as many as real/test holds
    shard_size: int = 1000  # samples per shard

    def __post_init__(self):
        unknown = [s for s in self.sets if s not in SETS]
        if unknown:
            raise ConfigError(
                f"sets: unknown {', '.join(map(repr, unknown))}; choose from: {', '.join(SETS)}"
            )
        check_range("noise_images", self.noise_images, 0)
        check_range("shard_size", self.shard_size, 1)


PRESETS = stage_presets("ood")  # the root's real/test says the image size and channels
