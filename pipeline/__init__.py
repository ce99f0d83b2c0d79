"""semix, the app on top: the CLI, chains (make generate), demo, study and the stage
registry. The bottom layer it stands on is core."""

from core import __version__

__all__ = ["__version__"]
