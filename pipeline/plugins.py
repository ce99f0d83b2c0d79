"""Parts from your own modules, no semix file edited: a loss, a preset, a generator backend, a
stage (docs/contributing.md).

    SEMIX_PLUGINS=my_losses,my_presets python -m pipeline train --set loss=toy

What mature tools do: pytest reads PYTEST_PLUGINS (module names, comma-separated) and the
`pytest11` entry points of installed packages; semix reads SEMIX_PLUGINS and the `semix.plugins`
entry points. The CLI imports them first, before any config is built (a config's fields derive
from the registries as they are then), and the processes it starts (the chain's, the study's,
a launcher's ranks) inherit the variable. A plugin registers its parts when it is imported:
`models.objectives.register_loss`, `stages.presets.register_preset`,
`models.generators.register_backend`, `pipeline.registry.register_stage`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os

from core.config import ConfigError

ENV = "SEMIX_PLUGINS"
GROUP = "semix.plugins"  # [project.entry-points."semix.plugins"] name = "module"


def load_plugins() -> list[str]:
    """Import every module SEMIX_PLUGINS names, then every `semix.plugins` entry point; returns
    the names imported. A module that is not there is refused in one line; an error inside a
    plugin is the plugin's, with its traceback."""
    names = [n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or not (name == e.name or name.startswith(f"{e.name}.")):
                raise  # the plugin imports something that is missing: its own error
            raise ConfigError(
                f"{ENV}: no module {name!r} to import; put its folder on PYTHONPATH or pip "
                "install it"
            ) from e
    for entry in _entry_points():
        entry.load()
        names.append(entry.value)
    return names


@functools.cache
def _entry_points() -> tuple[importlib.metadata.EntryPoint, ...]:
    """Read once a process: it scans every installed package's metadata."""
    return tuple(importlib.metadata.entry_points(group=GROUP))
