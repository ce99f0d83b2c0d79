"""semix benchmarks: `make bench` runs every bench/bench_*.py and writes bench/RESULTS.md."""

import os
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent  # the bench_*.py modules
REPO = BENCH.parent  # the checkout they measure
RESULTS = BENCH / "RESULTS.md"  # what `make bench` writes
FITTED = "generator/fidelity.json"  # in a run root: a fitted in-house generator


def run_root(
    bench: str, env: str, defaults: tuple[str, ...], marker: str, needs: str
) -> Path | None:
    """The run root a bench reads: $env if set, else the first of `defaults` that holds
    `marker` (a file the bench needs, relative to the root). None, said in one line (what is
    missing, how to make it; the bench's section in RESULTS.md is kept), when none does."""
    named = os.environ.get(env)
    candidates = [Path(named)] if named else [Path(d) for d in defaults]
    root = next((c for c in candidates if (c / marker).is_file()), None)
    if root is None:
        one = len(defaults) == 1
        where = f"{defaults[0] if one else 'runs/<preset>'}/{marker}"
        make = f"make generate CLASSES={Path(defaults[0]).name}" if one else "make generate"
        print(f"bench {bench}: no {needs} ({where}): run `{make}` first, or set {env}=<run root>; "
              "section kept")  # fmt: skip
    return root


def fit_config(folder: Path) -> Any:
    """A fitted generator's recorded config, as fit-generator's typed config (core.codec)."""
    from core.codec import load
    from stages.configs.fit_generator import Config

    return load(Config, folder)


def fitted_generator(root: Path) -> tuple[Any, dict, list]:
    """A fitted in-house generator's config (typed: `fit_config`), fidelity.json and the fit's
    judges, rebuilt as fit-generator built them (the chooser first, then the probe and the
    report judges)."""
    import json

    from stages.common.fidelity import make_judges

    config = fit_config(root / "generator")
    fidelity = json.loads((root / "generator" / "fidelity.json").read_text())
    report = [
        n.removeprefix("cnn:")
        for n, j in fidelity["judges"].items()
        if j["role"] == "reports only" and n.startswith("cnn:")
    ]
    judges = make_judges(root, config.fidelity.judge, "cpu", config.train_limit, report=report)
    return config, fidelity, judges
