"""The backends by name, what the generate config needs of each without importing it, and
`register_backend`, which adds one from your own module (docs/contributing.md).

A backend's module may pull in diffusers' pipelines and transformers (seconds on a small CPU).
unet's and edm's do when they are imported, so they are registered as "module:Class" and
``generator_class`` imports only the backend asked for: a config check, a plan or a one-line error
(an uncached model id offline) never waits for them. sd's and dit's import diffusers only when
they read weights: they are registered as classes, and the generate config reads their nested
``Params`` (the leaves they own, `backend.sd.*` and `backend.dit.*`) from them.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from core.parts import Params

from .base import Generator
from .dit import DiTGenerator
from .schedulers import SAMPLERS
from .sd import SDGenerator

# the edm backend's samplers (the others take schedulers.SAMPLERS)
EDM_SAMPLERS = {"heun": "EDM Algorithm 1, 2nd order", "euler": "1st order"}


@dataclass(frozen=True)
class Backend:
    """One backend: a part of the generate config's `backend` section (core.parts.Part)."""

    target: str | type[Generator]  # the class, or "module:Class", imported on first use
    params: type[Params]  # its own parameters: leaves `backend.<name>.<param>` of generate
    prefix: str
    every_run: bool = False  # core.parts.Part: the built-ins' parameters are in every config.json
    samplers: tuple[str, ...] = tuple(SAMPLERS)  # the config checks sampler= against these
    needs_model: bool = True  # model="" names nothing for it (unet, edm: a run-root folder)
    guidance: bool = True  # it takes classifier-free guidance (edm: refuses w != 1)


# backend name -> its entry, in the order --fields lists their parameters (register_backend)
GENERATORS: dict[str, Backend] = {}


def register_backend(
    name: str,
    target: str | type[Generator],
    *,
    params: type[Params] | None = None,
    samplers: Iterable[str] | None = None,
    needs_model: bool = True,
    guidance: bool = True,
    prefix: str = "",
    every_run: bool = False,
) -> None:
    """Add a generator backend from your own module: `backend=<name>` then generates with it,
    `backend.<param>=` sets its `Params`' parameters (leaves `backend.<name>.<param>`, `-` as
    `_`; config.json records them as `<prefix>_<param>`, prefix: the name, `-` as `_`).
    `target` is the `Generator` subclass (its `backend` is `name`), or "module:Class" for one
    whose module is slow to import: then `params` and
    `samplers` (its class's `Params` and `samplers`; default none and schedulers.SAMPLERS) are given
    here, since the config needs them before the class is imported. Register when your module is
    imported, which SEMIX_PLUGINS does before any config is built (pipeline/plugins.py)."""
    if name in GENERATORS:
        raise ValueError(f"backend {name!r} is registered already")
    lazy = isinstance(target, str)
    if not lazy:
        _check_class(name, target)
    entry = Backend(
        target,
        params or (Params if lazy else target.Params),
        prefix or name.replace("-", "_"),
        every_run,
        tuple(samplers or (SAMPLERS if lazy else target.samplers)),
        needs_model,
        guidance,
    )
    if not lazy:
        _check_class(name, target, entry)
    GENERATORS[name] = entry


def _check_class(name: str, cls: Any, entry: Backend | None = None) -> None:
    """The class must be the backend its entry describes: Params or samplers the entry lacks
    would be fields the config never had, choices it never checked."""
    if not (isinstance(cls, type) and issubclass(cls, Generator)):
        raise TypeError(f"backend {name!r}: {cls!r} is not a models.generators.Generator")
    said = getattr(cls, "backend", None)
    if said != name:
        raise TypeError(f"backend {name!r}: its class {cls.__name__} says backend = {said!r}")
    if entry and (cls.Params is not entry.params or set(cls.samplers) != set(entry.samplers)):
        raise TypeError(
            f"backend {name!r}: {cls.__name__}'s Params or samplers are not the ones registered; "
            "register its Params and samplers with it"
        )


register_backend("unet", ".unet:UNetGenerator", needs_model=False, every_run=True)
register_backend("sd", SDGenerator, every_run=True)
register_backend("dit", DiTGenerator, every_run=True)
register_backend(
    "edm", ".edm:EDMGenerator", samplers=EDM_SAMPLERS, needs_model=False, guidance=False,
    every_run=True,
)  # fmt: skip


def generator_class(backend: str) -> type[Generator]:
    """The class of backend ``backend``; a "module:Class" one is imported here, on first use."""
    if backend not in GENERATORS:
        raise ValueError(
            f"unknown generator backend {backend!r}; choose one of {sorted(GENERATORS)}"
        )
    entry = GENERATORS[backend]
    if not isinstance(entry.target, str):
        return entry.target
    module, name = entry.target.split(":")
    cls = getattr(importlib.import_module(module, __package__), name)
    _check_class(backend, cls, entry)
    return cls


def load_generator(backend: str, **kwargs: Any) -> Generator:
    """Build backend ``backend`` with its keyword arguments (``model=...`` etc.); with
    ``lazy=True`` no weights are read until ``load()`` or the first ``generate_series``."""
    return generator_class(backend)(**kwargs)
