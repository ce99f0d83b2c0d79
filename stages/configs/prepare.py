"""Config of the `prepare` stage: a real dataset -> runs/<classes>/real/{train,val,test}/."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.config import StageConfig, check_choice, check_range

SOURCES = (
    "digits", "fashion-mnist", "cifar10", "cifar100", "tiny-imagenet", "imagefolder", "imagenet",
)  # fmt: skip
RESIZE = ("squash", "center-crop")


@dataclass(frozen=True)
class Config(StageConfig):
    source: str = "digits"
    data_dir: str = ""  # local archive file / dataset folder; takes precedence over hf_dataset
    hf_dataset: str = ""  # Hugging Face datasets id or local folder (cifar10/cifar100)
    image_size: int = 0  # square side in pixels; 0 keeps the native size
    # how images of another size become image_size x image_size: squash (both sides, aspect not
    # kept) | center-crop (shorter side to image_size, then the centre)
    resize: str = "squash"
    val_fraction: float = 0.1  # of train, stratified and seeded (METHODS §3: 10 % held out)
    test_fraction: float = 0.2  # only for datasets without an official test split
    shard_size: int = 1000  # samples per shard

    def __post_init__(self):
        check_choice("source", self.source, SOURCES)
        check_range("val_fraction", self.val_fraction, 0.0, 0.5)
        check_range("test_fraction", self.test_fraction, 0.0, 0.5)
        check_range("shard_size", self.shard_size, 1)
        check_range("image_size", self.image_size, 0)
        check_choice("resize", self.resize, RESIZE)

    def to_dict(self) -> dict[str, Any]:
        """`resize` is recorded only when not the default: config.json of the presets that
        squash stays the file it was (so their real/ folders still resume)."""
        d = super().to_dict()
        if d["resize"] == "squash":
            del d["resize"]
        return d


PRESETS = {
    # digits: 8x8 originals upsampled to 16x16, the size the tiny in-house UNet works at.
    "digits": dict(source="digits", image_size=16, shard_size=128),
    # the full 60k/10k set at its native 28x28 (Debian's dataset-fashion-mnist, offline)
    "fashion-mnist": dict(source="fashion-mnist", image_size=28, shard_size=2000),
    "cifar10": dict(source="cifar10", hf_dataset="uoft-cs/cifar10", image_size=32),
    "cifar100": dict(source="cifar100", hf_dataset="uoft-cs/cifar100", image_size=32),
    "tiny-imagenet": dict(source="tiny-imagenet", image_size=64),
    "imagefolder": dict(source="imagefolder", image_size=32),
    # ImageNet-1k (ILSVRC-2012 class folders, data_dir=): 1,000 classes at the 256 px of the
    # imagenet generator (DiT-XL/2-256), shorter side then centre crop as DiT's training data;
    # image_size= sets another resolution (generate follows real/'s)
    "imagenet": dict(source="imagenet", image_size=256, resize="center-crop"),
}
