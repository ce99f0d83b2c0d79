"""The code that runs: its version, recorded in every manifest."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

from core import __version__


@functools.cache
def code_version() -> str:
    """'0.1.0' plus the git commit when run from a checkout: recorded in every manifest."""
    repo = Path(__file__).resolve().parents[1]  # core/version.py -> the checkout
    if (repo / ".git").exists():
        try:
            sha = subprocess.run(
                ["git", "rev-parse", "--short=12", "HEAD"],
                cwd=repo,
                capture_output=True,
                text=True,
                timeout=5,
                check=True,
            ).stdout.strip()
            return f"{__version__}+g{sha}"
        except (OSError, subprocess.SubprocessError):
            pass  # no git binary or not a repository: the version alone is still truthful
    return __version__
