"""semix benchmarks: `make bench` runs every bench/bench_*.py and writes bench/RESULTS.md."""

import os
from pathlib import Path


def run_root(env: str, defaults: tuple[str, ...], marker: str) -> Path | None:
    """The run root a bench reads: $env if set, else the first of `defaults`; None unless it
    holds `marker` (a file the bench needs, relative to the root)."""
    named = os.environ.get(env)
    candidates = [Path(named)] if named else [Path(d) for d in defaults]
    return next((c for c in candidates if (c / marker).is_file()), None)


def fitted_generator(root: Path) -> tuple[dict, dict, list]:
    """A fitted in-house generator's config.json, fidelity.json and the fit's judges, rebuilt
    as fit-generator built them (the chooser first, then the probe and the report judges)."""
    import json

    from stages.common.fidelity import make_judges

    config = json.loads((root / "generator" / "config.json").read_text())
    fidelity = json.loads((root / "generator" / "fidelity.json").read_text())
    report = [
        n.removeprefix("cnn:")
        for n, j in fidelity["judges"].items()
        if j["role"] == "reports only" and n.startswith("cnn:")
    ]
    judges = make_judges(
        root, config.get("judge_run", ""), "cpu", int(config.get("train_limit", 0)), report=report
    )
    return config, fidelity, judges
