"""Shared fixtures: small real data on disk, built once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("SEMIX_NO_PROGRESS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def subprocess_env() -> dict[str, str]:
    """Environment for `python -m pipeline` subprocesses run from any cwd."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="session")
def digits_root(tmp_path_factory) -> Path:
    """runs/digits/ with real/{train,val,test} prepared once for the whole session.

    Read-only for tests: copy it (shutil.copytree) before writing next to it.
    """
    from pipeline.cli import run_stage

    out = tmp_path_factory.mktemp("runs")
    run_stage("prepare", "digits", [f"out={out}"])
    return out / "digits"
