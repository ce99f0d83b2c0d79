"""tiny-imagenet: Tiny-ImageNet (100k photos of 200 classes at 64x64; data_dir=tiny-imagenet-200).

CIFAR-10's photo chain and classifier with the paper's Tiny-ImageNet values; no in-house
generator recipe (a pretrained one renders the series).
"""

from __future__ import annotations

from stages.presets.base import CLIP, SD, Preset, edm, fedlas

# docs/methods.md §5's Tiny-ImageNet values
FEDLAS = fedlas(
    ls={"alpha": 0.05, "beta": 4.0, "theta": 0.5},
    mbls={"alpha": 0.05, "beta": 0.5, "theta": 0.5, "margin": 10.0},
)


def _read(cfg):
    from shards.image_folders import tiny_imagenet_source

    return tiny_imagenet_source(cfg.data_dir)


PRESET = Preset(
    name="tiny-imagenet",
    stages={
        "prepare": dict(source="tiny-imagenet", image_size=64),
        "train": {"model": "resnet50", "loss.mbls.m": 10.0, "loss.mbls.lam": 0.05, **FEDLAS},
        "finetune": FEDLAS,
        # docs/methods.md §1: 2 series per pair (about 318k images); EDM: 25 Heun steps
        "generate": SD | {"mixing.series_per_pair": 2, "when": edm(25)},
        "annotate": dict(CLIP, sharpening=4.0),  # docs/methods.md §2's s
    },
    reads=_read,
    reads_fields=("data_dir",),
    edm_checkpoint="the Tiny-ImageNet 64x64 cond-vp EDM of DM-Improves-AT "
    "(https://huggingface.co/wzekai99/DM-Improves-AT, folder others/)",
)
