"""The layers the folders show: import-linter's contract in pyproject.toml, run as CI runs it.

    bench/              benchmarks: may use anything
    pipeline/ (the app) cli, chain, demo, study, the stage registry: on everything below
    stages/             a module or package per stage, never importing another; common/,
                        configs/, presets/: on models and shards
    models/ | shards/   pure torch numerics | everything on disk: on core only, never each other
    core/               config, seeding, launch, io, plots: used by every package, imports
                        none of them

Every import counts, module-level or inside a function (a lazy import is still a dependency).
Stages are found by name through the registry (importlib), which is how the app reaches them
without a cycle.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("bench", "pipeline", "stages", "models", "shards", "core")
LINT = str(Path(sys.executable).parent / "lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess:
    """lint-imports on the project at `root` (its pyproject.toml's contracts)."""
    cmd = [LINT, "--no-cache", "--no-logo"]
    return subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)


def test_every_import_points_down_and_no_package_has_a_cycle():
    result = lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


@pytest.fixture
def copy(tmp_path) -> Path:
    """The project's packages and contract, copied to be broken on purpose."""
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def test_a_lazy_upward_import_breaks_the_layers(copy):
    with open(copy / "core" / "io.py", "a") as f:
        f.write("\n\ndef _planted():\n    import shards.manifest  # upward, inside a function\n")
    result = lint(copy)
    assert result.returncode == 1
    assert "core is not allowed to import shards" in result.stdout
    assert "core.io -> shards.manifest" in result.stdout


def test_a_cycle_between_modules_of_a_package_breaks_the_contract(copy):
    with open(copy / "pipeline" / "study" / "config.py", "a") as f:
        f.write("\n\ndef _planted():\n    from pipeline.study.plan import plan  # closes a loop\n")
    result = lint(copy)
    assert result.returncode == 1 and "2 kept, 1 broken" in result.stdout
    assert ".config -> .plan" in result.stdout


def test_a_stage_importing_another_breaks_the_stages_contract(copy):
    with open(copy / "stages" / "train.py", "a") as f:
        f.write("\n\ndef _planted():\n    from stages.evaluate import run  # another stage\n")
    result = lint(copy)
    assert result.returncode == 1 and "2 kept, 1 broken" in result.stdout
    assert "stages.train -> stages.evaluate" in result.stdout


@pytest.mark.parametrize("package", ["models", "shards", "stages", "pipeline", "core"])
def test_module_sizes(package):
    # ~400 lines is a reading guide, not a wall: a module over it gets a warning (split it
    # where the code has a seam, not at the line count); one over 600 is a file nobody reads
    # top to bottom and fails
    sizes = {
        str(p.relative_to(REPO)): len(p.read_text().splitlines())
        for p in (REPO / package).rglob("*.py")
    }
    long = {name: n for name, n in sizes.items() if n > 400}
    if long:
        warnings.warn(f"modules over ~400 lines: {long}", stacklevel=1)
    assert not {name: n for name, n in long.items() if n > 600}, f"modules over 600 lines: {long}"


def test_the_stages_contract_lists_every_built_in_stage():
    # a stage added to the registry but not to the contract could import another stage unseen
    import tomllib

    from pipeline.registry import STAGES

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (stages,) = [c for c in contracts["contracts"] if c["id"] == "stages"]
    built_in = {s.module for s in STAGES.values() if s.module.startswith("stages.")}
    assert set(stages["modules"]) == built_in
