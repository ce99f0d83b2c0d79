"""cifar100: CIFAR-100 (50k/10k photos, 32x32, 100 classes): CIFAR-10's recipe with the paper's
100-class values (sharpening, FeDLaS, the series budget)."""

from __future__ import annotations

from shards.sources import CifarLayout, cifar_source
from stages.presets.base import Preset, edm, fedlas

LAYOUT = CifarLayout(
    name="cifar100",
    archive="cifar-100-python.tar.gz",
    train_members=("train",),
    test_member="test",
    meta_member="meta",
    label_key="fine_labels",
    names_key="fine_label_names",
    hf_columns=("img", "fine_label"),
)

# docs/methods.md §5's CIFAR-100 values
FEDLAS = fedlas(
    ls={"alpha": 0.1, "beta": 4.0, "theta": 0.5},
    mbls={"alpha": 0.1, "beta": 1.0, "theta": 0.5, "margin": 6.0},
)

PRESET = Preset(
    name="cifar100",
    extends="cifar10",
    stages={
        "prepare": dict(source="cifar100", hf_dataset="uoft-cs/cifar100"),
        "train": FEDLAS,
        "finetune": FEDLAS,
        # docs/methods.md §1: 4 series per pair (about 158k images); EDM: 25 Heun steps
        "generate": {"mixing.series_per_pair": 4, "when": edm(25)},
        # docs/methods.md §2: 2.3 for the 100-class set, where prototypes crowd closer
        "annotate": dict(sharpening=2.3),
    },
    reads=lambda cfg: cifar_source(LAYOUT, cfg.data_dir, cfg.hf_dataset),
    edm_checkpoint="https://huggingface.co/wzekai99/DM-Improves-AT/resolve/main/others/"
    "edm-cifar100-cond-32x32-cond-vp.pkl",
)
