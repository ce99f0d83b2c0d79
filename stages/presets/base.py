"""What a preset is, and the pieces several presets share.

A preset is a dataset and a recipe for it: for each stage the config fields that differ from the
stage's defaults (`stages/configs/<stage>.py`), the steps of its chain (`make chain`), and what
it knows of its data (how prepare reads it, where the paper's EDM network for its classes is
published, the license its images carry). Nothing below the stages names a preset: where a
model or a shard needs one of these values, a stage passes it in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Step = tuple[str, tuple[str, ...]]  # (stage, the --set values the chain gives it)


@dataclass(frozen=True)
class Preset:
    name: str
    # stage -> {field: value} where the preset differs from the stage config's defaults; a
    # "when" entry {"field=value": {...}} holds values that apply only when that field resolves
    # to that value (core.config.resolve)
    stages: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # the preset whose recipe this one starts from: its stage values (this preset's own win,
    # field by field) and its chain, never its data (the three fields below)
    extends: str = ""
    chain: tuple[Step, ...] | None = None  # None: the extended preset's, else DEFAULT_CHAIN
    # prepare's reader of `source=<name>`: (prepare config) -> shards.sources.Source; None: the
    # preset reads no data of its own
    reads: Callable[[Any], Any] | None = None
    # the prepare fields that reader reads: a value in one it ignores is refused, never a
    # silent run on other data (`--preset digits --set data_dir=...`)
    reads_fields: tuple[str, ...] = ("data_dir", "hf_dataset")
    edm_checkpoint: str = ""  # where the paper's EDM network for these classes is published
    # (Hub license id, what the data is): the in-house UNet learns only from the real training
    # set, so the images it makes carry the data's license (shards.card.license_for)
    data_license: tuple[str, str] | None = None


# the chain of a preset that names none: a pretrained generator, CLIP features
DEFAULT_CHAIN: tuple[Step, ...] = (("prepare", ()), ("generate", ()), ("annotate", ()))

# ---------------------------------------------------------------- what the photo presets share

# annotate: OpenCLIP's ViT-B-32 (OpenAI weights) as the annotation space
CLIP = {
    "encoder": "openclip",
    "encoder.openclip.model": "ViT-B-32",
    "encoder.openclip.pretrained": "openai",
}

# Pretrained text-to-image model of the photo presets; a local save_pretrained folder works too
# (model=/path). Generated at 512x512 and resized to the dataset's resolution (docs/methods.md §1).
SD15 = "stable-diffusion-v1-5/stable-diffusion-v1-5"
SD = dict(backend="sd", model=SD15, sample_steps=25, guidance=7.5, batch_size=16)


def edm(sample_steps: int) -> dict:
    """`--set backend=edm` on a photo preset: the paper's EDM sampling (docs/methods.md §1): Heun,
    σ 0.002..80, ρ 7, no guidance; the EDM networks are CC BY-NC-SA 4.0."""
    values = dict(model="", sampler="heun", sample_steps=sample_steps, guidance=1.0, batch_size=256)
    return {"backend=edm": values | dict(license="cc-by-nc-sa-4.0")}


def fedlas(ls: Mapping[str, float], mbls: Mapping[str, float]) -> dict[str, float]:
    """The FeDLaS leaves of train and finetune (the same paths in both) from docs/methods.md §5's
    per-dataset values of the -LS and -MbLS variants (the gate's θ is the LS variant's)."""
    return {
        "loss.fedlas_ls.alpha": ls["alpha"],
        "loss.fedlas_ls.beta": ls["beta"],
        "loss.fedlas_mbls.alpha": mbls["alpha"],
        "loss.fedlas_mbls.beta": mbls["beta"],
        "loss.fedlas_mbls.margin": mbls["margin"],
        "loss.fedlas_ls.theta": ls["theta"],
    }
