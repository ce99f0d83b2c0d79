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
