"""Generator backends behind one interface (ARCHITECTURE §4): ``generate_series(specs)``.

gen = load_generator("unet", model="runs/digits/generator", steps=25)
images = gen.generate_series([SeriesSpec(0, 3, 8, (1.0, 0.5, 0.0), seed=123)])  # uint8 [1, 3, H, W, 3]
mix = MixSpec(0, (3, 5, 8), ((1.0, 0.0, 0.0), (0.5, 0.25, 0.25)), seed=123)  # a k = 3 series
"""

from __future__ import annotations

from typing import Any

from .base import (
    SAMPLERS,
    Generator,
    MixableEmbedding,
    ModelNotFoundError,
    NonFiniteImageError,
    make_scheduler,
)
from .dit import DiTGenerator
from .edm import EDM_CHECKPOINTS, EDM_SAMPLERS, EDMGenerator, load_edm
from .edm_net import EDMNetwork
from .edm_pickle import UnsafePickleError, convert_edm_pickle, read_edm_pickle
from .sd import SDGenerator
from .spec import MixSpec, SeriesSpec
from .unet import (
    UNET_PRESETS,
    UNetGenerator,
    UNetPreset,
    build_unet,
    load_unet,
    save_unet,
    unet_from_preset,
)

GENERATORS: dict[str, type[Generator]] = {
    cls.backend: cls for cls in (UNetGenerator, SDGenerator, DiTGenerator, EDMGenerator)
}


def load_generator(backend: str, **kwargs: Any) -> Generator:
    """Build backend ``backend`` with its keyword arguments (``model=...`` etc.); with
    ``lazy=True`` no weights are read until ``load()`` or the first ``generate_series``."""
    if backend not in GENERATORS:
        raise ValueError(
            f"unknown generator backend {backend!r}; choose one of {sorted(GENERATORS)}"
        )
    return GENERATORS[backend](**kwargs)


__all__ = [
    "EDM_CHECKPOINTS",
    "EDM_SAMPLERS",
    "GENERATORS",
    "SAMPLERS",
    "UNET_PRESETS",
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
    "save_unet",
    "unet_from_preset",
]
