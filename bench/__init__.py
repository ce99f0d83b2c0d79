"""semix benchmarks: `make bench` runs every bench/bench_*.py and writes bench/RESULTS.md."""

import os
from pathlib import Path


def run_root(env: str, defaults: tuple[str, ...], marker: str) -> Path | None:
    """The run root a bench reads: $env if set, else the first of `defaults`; None unless it
    holds `marker` (a file the bench needs, relative to the root)."""
    named = os.environ.get(env)
    candidates = [Path(named)] if named else [Path(d) for d in defaults]
    return next((c for c in candidates if (c / marker).is_file()), None)
