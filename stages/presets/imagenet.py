"""imagenet: ImageNet-1k (ILSVRC-2012 class folders, data_dir=): 1,000 classes at 256 px, rendered
by DiT-XL/2, which is class-conditional on these very classes."""

from __future__ import annotations

from stages.presets.base import CLIP, Preset

DIT_XL_256 = "facebook/DiT-XL-2-256"  # its class-conditional generator


def _read(cfg):
    from shards.image_folders import imagenet_source

    return imagenet_source(cfg.data_dir)


PRESET = Preset(
    name="imagenet",
    stages={
        # 256 px, the resolution of the generator (DiT-XL/2-256), shorter side then centre crop
        # as DiT's training data; image_size= sets another resolution (generate follows real/'s)
        "prepare": dict(source="imagenet", image_size=256, resize="center-crop"),
        # the ImageNet ResNet-50 (timm's, 7x7 stem for 224-256 px) and its standard recipe (90
        # epochs, lr ÷10 at 30 and 60, wd 1e-4, batch 256)
        "train": dict(model="timm:resnet50", epochs=90, batch_size=256)
        | {"optim.milestones": (30, 60), "optim.weight_decay": 1e-4},
        # our class i, the i-th sorted wnid, is DiT's label i; 256 px, stored at real/'s
        # resolution. CSM's budget of ~3x the real training set: 1 series per pair = 499,500
        # series, 3,996,000 images. No guidance, as CSM (DiT's usual 1.5-4 is `--set
        # guidance=...`); DDIM 50 steps.
        "generate": dict(
            backend="dit",
            model=DIT_XL_256,
            sample_steps=50,
            guidance=1.0,
            batch_size=64,
        )
        | {"backend.dit.class_ids": tuple(range(1000)), "mixing.series_per_pair": 1},
        "annotate": dict(CLIP, sharpening=4.0),  # GUESS: the papers give none; Tiny-ImageNet's
    },
    reads=_read,
    reads_fields=("data_dir",),
)
