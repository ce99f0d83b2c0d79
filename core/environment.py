"""semix's own environment variables, checked once when a command starts: a value semix would
misread or ignore (`SEMIX_PROGRESS=bogus`, `SEMIX_DEBUG=yes`) is one line before any work, not
a silent default or an error halfway through a stage."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from core.config import ConfigError, did_you_mean
from core.logs import PROGRESS_MODES


def _seconds(value: str) -> bool:
    try:
        return float(value) > 0
    except ValueError:
        return False


FLAG = ("0", "1")  # off, on
# name -> (whether a value is valid, what the variable takes); "" is unset for each of them
VARIABLES: dict[str, tuple[Callable[[str], bool], str]] = {
    "SEMIX_DEBUG": (lambda v: v in FLAG, "1 (show tracebacks) or 0"),
    "SEMIX_NO_PROGRESS": (lambda v: v in FLAG, "1 (no progress) or 0"),
    "SEMIX_PROGRESS": (
        lambda v: v.strip().lower() in PROGRESS_MODES,
        f"one of {', '.join(PROGRESS_MODES)}",
    ),
    "SEMIX_PROGRESS_EVERY": (_seconds, "a number of seconds > 0"),
    "SEMIX_DIST_TIMEOUT": (_seconds, "a number of seconds > 0"),
}


def check_environment(environ: Mapping[str, str] = os.environ) -> None:
    """Refuse, in one line, the first of semix's variables whose value it cannot use."""
    for name, (valid, takes) in VARIABLES.items():
        value = environ.get(name, "")
        if value.strip() and not valid(value):
            guess = ""
            if name == "SEMIX_PROGRESS":
                guess = did_you_mean(value.strip().lower(), PROGRESS_MODES)
            raise ConfigError(f"{name}={value!r} is not valid; {guess}it takes {takes}")
