"""imagefolder: your own images in class folders (data_dir=; `<class>/` folders, or `train/<class>/`
and `test/<class>/`), or the classes a .txt file names (`--preset classes.txt`).

Alone it runs the photo chain (Stable Diffusion, OpenCLIP) at 32x32; with `--recipe NAME` the
data stay these folders and every other value is the recipe's (`make study CLASSES=imagefolder
RECIPE=fashion-mnist`: the fair in-house chain of the study on small images).
"""

from __future__ import annotations

from pathlib import Path

from core.config import ConfigError
from stages.presets.base import CLIP, SD, Preset


def read_class_names(path: str | Path) -> tuple[str, ...]:
    """One class name per line; blank lines and '#' comments ignored; duplicates refused."""
    names = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    if not names:
        raise ConfigError(f"classes file {path} lists no class names")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"classes file {path} repeats class names: {', '.join(dupes)}")
    return tuple(names)


def _read(cfg):
    from shards.image_folders import imagefolder_source

    names = read_class_names(cfg.classes_file) if cfg.classes_file else ()
    return imagefolder_source(cfg.data_dir, names)


PRESET = Preset(
    name="imagefolder",
    stages={
        "prepare": dict(source="imagefolder", image_size=32),
        "train": dict(model="resnet50"),
        "finetune": {},
        "generate": SD | {"mixing.series_per_pair": 4},
        "annotate": dict(CLIP, sharpening=4.0),  # CIFAR-10's s (docs/methods.md §2)
    },
    reads=_read,
    reads_fields=("data_dir",),
)
