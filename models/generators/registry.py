"""The backends by name, without importing them.

A backend's module pulls in diffusers' pipelines and transformers (seconds on a small CPU), so
the registry names its module and ``load_generator`` imports only the backend asked for: a config
check, a plan or a one-line error (an uncached model id offline) never waits for the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import Generator

# backend name -> "module:class" under models.generators (the class's ``backend`` is the name)
GENERATORS: dict[str, str] = {
    "unet": "unet:UNetGenerator",
    "sd": "sd:SDGenerator",
    "dit": "dit:DiTGenerator",
    "edm": "edm:EDMGenerator",
}

# the edm backend's samplers (the others take base.SAMPLERS)
EDM_SAMPLERS = {"heun": "EDM Algorithm 1, 2nd order", "euler": "1st order"}

# Where the paper's networks are published (EDM: CC BY-NC-SA 4.0)
EDM_CHECKPOINTS = {
    "cifar10": "https://nvlabs-fi-cdn.nvidia.com/edm/pretrained/edm-cifar10-32x32-cond-vp.pkl",
    "cifar100": "https://huggingface.co/wzekai99/DM-Improves-AT/resolve/main/others/"
    "edm-cifar100-cond-32x32-cond-vp.pkl",
    "tiny-imagenet": "the Tiny-ImageNet 64x64 cond-vp EDM of DM-Improves-AT "
    "(https://huggingface.co/wzekai99/DM-Improves-AT, folder others/)",
}


def generator_class(backend: str) -> type[Generator]:
    """The class of backend ``backend``; its module is imported here, on first use."""
    if backend not in GENERATORS:
        raise ValueError(
            f"unknown generator backend {backend!r}; choose one of {sorted(GENERATORS)}"
        )
    module, name = GENERATORS[backend].split(":")
    return getattr(importlib.import_module(f".{module}", __package__), name)


def load_generator(backend: str, **kwargs: Any) -> Generator:
    """Build backend ``backend`` with its keyword arguments (``model=...`` etc.); with
    ``lazy=True`` no weights are read until ``load()`` or the first ``generate_series``."""
    return generator_class(backend)(**kwargs)
