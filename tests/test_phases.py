"""SEMIX_PHASES: where a training process's time goes (stages/common/phases.py), for the
profiling bench (bench/bench_study_task.py); the outputs are the same bytes with it or without."""

from __future__ import annotations

import atexit
import json
import shutil
import time

import pytest

from pipeline.registry import run_train_stack
from stages.common import phases

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["epochs=2", "train_limit=128", "batch_size=64"]


@pytest.fixture
def record(monkeypatch, tmp_path):
    """SEMIX_PHASES set for one test; the process's record dropped afterwards (no exit write)."""
    path = tmp_path / "phases.json"
    monkeypatch.setenv(phases.ENV, str(path))
    yield path
    if phases._record is not None:
        atexit.unregister(phases._record.write)
    phases._record = None


def test_without_the_variable_nothing_is_recorded(monkeypatch):
    monkeypatch.delenv(phases.ENV, raising=False)
    with phases.phase("steps"):
        phases.count("epochs")
    assert phases.snapshot() is None


def test_phases_add_calls_wall_and_cpu_and_write_json(record):
    phases.begin()
    for _ in range(2):
        with phases.phase("busy"):
            t0 = time.process_time()
            while time.process_time() - t0 < 0.05:  # burn CPU: the phase's CPU counts it
                pass
    with phases.phase("idle"):
        time.sleep(0.05)  # wall without CPU
    phases.count("images", 3)
    phases.count("images", 4)
    phases._record.write()
    saved = json.loads(record.read_text())
    busy, idle = saved["phases"]["busy"], saved["phases"]["idle"]
    assert busy["calls"] == 2 and busy["cpu_s"] >= 0.09 and busy["wall_s"] >= busy["cpu_s"] * 0.5
    assert idle["calls"] == 1 and idle["wall_s"] >= 0.05 and idle["cpu_s"] < 0.05
    assert saved["counts"] == {"images": 7}
    assert saved["end"]["cpu_s"] >= saved["start"]["cpu_s"] + 0.09
    assert saved["threads_max"] >= 1


def test_a_profiled_stack_counts_its_work_and_trains_the_same_bytes(
    record, digits_root, tmp_path, monkeypatch
):
    """Two seeds of 2 epochs: 4 epochs, each validating all of real/val once, the data decoded
    once; model.safetensors byte for byte those of the same stack trained without the timer."""
    roots = []
    for name in ("profiled", "plain"):
        root = tmp_path / name / "digits"
        shutil.copytree(digits_root / "real", root / "real")
        roots.append(root)
    sets = [
        [f"out={roots[0].parent}", f"run=ce-s{s}", f"seed={s}", "loss=ce", *TINY] for s in (1, 2)
    ]
    run_train_stack("digits", sets)
    seen = phases.snapshot()
    monkeypatch.delenv(phases.ENV)
    plain = [[f"out={roots[1].parent}", *s[1:]] for s in sets]
    run_train_stack("digits", plain)

    from shards.reader import load_split

    val = len(load_split(roots[0] / "real" / "val").labels)
    assert seen["counts"]["epochs"] == 4
    assert seen["counts"]["images_validated"] == 4 * val
    assert seen["counts"]["images_decoded"] == 128 + val  # train_limit + val, once for both
    for name in ("steps", "validation", "checkpoint"):
        assert seen["phases"][name]["calls"] == 4, name
    assert seen["phases"]["data"]["calls"] == 2 and seen["phases"]["outputs"]["calls"] == 2
    for s in (1, 2):
        a, b = (r / "train" / f"ce-s{s}" / "model.safetensors" for r in roots)
        assert a.read_bytes() == b.read_bytes()


def test_an_unwritable_file_is_one_line_at_exit(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(phases.ENV, str(tmp_path / "no" / "such" / "folder" / "phases.json"))
    try:
        with phases.phase("steps"):
            pass
        phases._record.write()
    finally:
        atexit.unregister(phases._record.write)
        phases._record = None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"semix: {phases.ENV}=") and "not written" in err[0]
