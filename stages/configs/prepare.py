"""Config of the `prepare` stage: a real dataset -> runs/<classes>/real/{train,val,test}/."""

from __future__ import annotations

from dataclasses import dataclass

from core.config import ConfigError, StageConfig, check_choice, check_range, recorded_off_default
from stages.presets import DEFAULT, SOURCES, reads_fields, stage_presets, unread_fields

RESIZE = ("squash", "center-crop")


@dataclass(frozen=True)
class Config(StageConfig):
    source: str = DEFAULT
    data_dir: str = ""  # local archive file / dataset folder; takes precedence over hf_dataset
    hf_dataset: str = ""  # Hugging Face datasets id or local folder (cifar10/cifar100)
    image_size: int = 0  # square side in pixels; 0 keeps the native size
    # how images of another size become image_size x image_size: squash (both sides, aspect not
    # kept) | center-crop (shorter side to image_size, then the centre)
    resize: str = recorded_off_default("squash")
    val_fraction: float = 0.1  # of train, stratified and seeded (docs/methods.md §3: 10 % held out)
    test_fraction: float = 0.2  # only for datasets without an official test split
    shard_size: int = 1000  # samples per shard

    def __post_init__(self):
        check_choice("source", self.source, SOURCES)
        check_range("val_fraction", self.val_fraction, 0.0, 0.5)
        check_range("test_fraction", self.test_fraction, 0.0, 0.5)
        check_range("shard_size", self.shard_size, 1)
        check_range("image_size", self.image_size, 0)
        check_choice("resize", self.resize, RESIZE)
        where = {"data_dir": self.data_dir, "hf_dataset": self.hf_dataset}
        for key in unread_fields(self.source, where):
            takes = " and ".join(f"{k}=" for k in reads_fields(self.source))
            takes = f"takes {takes} only" if takes else "brings its own data"
            raise ConfigError(
                f"{key}={where[key]} is never read: source={self.source} {takes}; drop {key}=, "
                "or choose the preset for your data (imagefolder: a folder of class folders)"
            )


PRESETS = stage_presets("prepare")
