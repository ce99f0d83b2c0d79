"""cifar10: CIFAR-10 (50k/10k photos, 32x32, 10 classes), the CSM paper's reference recipe.

The photo presets' chain: a pretrained Stable Diffusion renders the series, OpenCLIP annotates;
`--set backend=edm` switches to the paper's class-conditional EDM network. cifar100 extends it.
"""

from __future__ import annotations

from shards.sources import CifarLayout, cifar_source
from stages.presets.base import CLIP, SD, Preset, edm

LAYOUT = CifarLayout(
    name="cifar10",
    archive="cifar-10-python.tar.gz",
    train_members=tuple(f"data_batch_{i}" for i in range(1, 6)),
    test_member="test_batch",
    meta_member="batches.meta",
    label_key="labels",
    names_key="label_names",
    hf_columns=("img", "label"),
)

# The fit follows DDPM (Ho et al. 2020) on EDM's DDPM++ capacity ("cifar" UNet): linear betas,
# lr 2e-4 after 5k warm-up steps, EMA 0.9999, flips, bf16; 400k steps at batch 128 per GPU
# (about a day on 8 GPUs); not run on the development machine.
FIT = dict(unet="cifar", train_steps=400_000, batch_size=128, precision="bf16", log_every=500) | {
    "optim.lr": 2e-4,
    "optim.warmup_steps": 5000,
    "optim.ema_decay": 0.9999,
    "noise.beta_schedule": "linear",
    "augment.flip": True,
    "checkpoint.every": 5000,
}

PRESET = Preset(
    name="cifar10",
    stages={
        "prepare": dict(source="cifar10", hf_dataset="uoft-cs/cifar10", image_size=32),
        # docs/methods.md §3: ResNet-50, SGD 0.1, 200 epochs (the train config's defaults); FeDLaS:
        # docs/methods.md §5's CIFAR-10 values, the train and finetune configs' defaults
        "train": dict(model="resnet50"),
        "finetune": {},
        "fit-generator": FIT,
        # docs/methods.md §1 reference budget: 444 series per pair (about 160k images); `--set
        # backend=edm` switches to the paper's EDM network with its 20 Heun steps
        "generate": SD | {"mixing.series_per_pair": 444, "when": edm(20)},
        "annotate": dict(CLIP, sharpening=4.0),  # docs/methods.md §2's s
    },
    reads=lambda cfg: cifar_source(LAYOUT, cfg.data_dir, cfg.hf_dataset),
    edm_checkpoint="https://nvlabs-fi-cdn.nvidia.com/edm/pretrained/edm-cifar10-32x32-cond-vp.pkl",
)
