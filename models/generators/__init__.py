"""Generator backends behind one interface (docs/architecture.md): ``generate_series(specs)``.

gen = load_generator("unet", model="runs/digits/generator", steps=25)
images = gen.generate_series([SeriesSpec(0, 3, 8, (1.0, 0.5, 0.0), seed=123)])  # uint8 [1, 3, H, W, 3]
mix = MixSpec(0, (3, 5, 8), ((1.0, 0.0, 0.0), (0.5, 0.25, 0.25)), seed=123)  # a k = 3 series
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base import Generator, MixableEmbedding, NonFiniteImageError
from .loading import ModelNotFoundError
from .registry import EDM_SAMPLERS, GENERATORS, Backend, load_generator, register_backend
from .schedulers import SAMPLERS, make_scheduler
from .spec import MixSpec, SeriesSpec
from .unet_presets import UNET_PRESETS, UNetPreset

# The backends' modules import diffusers' pipelines and transformers (seconds): their names are
# imported on first use (PEP 562), so `from models.generators import SeriesSpec` stays light.
_LAZY = {
    "dit": ("DiTGenerator",),
    "edm": ("EDMGenerator", "load_edm"),
    "edm_net": ("EDMNetwork",),
    "edm_pickle": ("UnsafePickleError", "convert_edm_pickle", "read_edm_pickle"),
    "sd": ("SDGenerator",),
    "unet": (
        "UNetGenerator", "build_unet", "load_unet", "save_unet", "unet_from_preset",
    ),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from .dit import DiTGenerator
    from .edm import EDMGenerator, load_edm
    from .edm_net import EDMNetwork
    from .edm_pickle import UnsafePickleError, convert_edm_pickle, read_edm_pickle
    from .sd import SDGenerator
    from .unet import (
        UNetGenerator,
        build_unet,
        load_unet,
        save_unet,
        unet_from_preset,
    )


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
    globals()[name] = value  # imported once
    return value


__all__ = [
    "EDM_SAMPLERS",
    "GENERATORS",
    "SAMPLERS",
    "UNET_PRESETS",
    "Backend",
    "DiTGenerator",
    "EDMGenerator",
    "EDMNetwork",
    "Generator",
    "MixSpec",
    "MixableEmbedding",
    "ModelNotFoundError",
    "NonFiniteImageError",
    "SDGenerator",
    "SeriesSpec",
    "UNetGenerator",
    "UNetPreset",
    "UnsafePickleError",
    "build_unet",
    "convert_edm_pickle",
    "load_edm",
    "load_generator",
    "load_unet",
    "make_scheduler",
    "read_edm_pickle",
    "register_backend",
    "save_unet",
    "unet_from_preset",
]
