"""bench/bench_study_task.py's arithmetic: FLOPs per run, and a job's wall split into its parts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench.bench_study_task import PHASES, breakdown, run_flops, steps_of


def test_csm_steps_are_three_times_ce_steps_and_validation_adds_per_image():
    ce, csm = run_flops("ce", 1, 128, 0), run_flops("csm", 1, 128, 0)
    assert ce > 0 and csm == 3 * ce  # the network on 2 mixed images per real one, its own pass
    one, two = run_flops("ce", 1, 0, 64), run_flops("ce", 2, 0, 128)
    assert one > 0 and two == 4 * one  # epochs x validation images
    assert run_flops("ce", 3, 256, 0) == 6 * ce  # epochs x ceil(train / batch) steps
    assert steps_of("ce", seeds=10, epochs=20) == 10 * 20 * 40  # 5000 images, batches of 128


def job(tmp_path, phases: dict | None) -> SimpleNamespace:
    folders = []
    for s, seconds in ((1, [2.0, 3.0]), (2, [4.0])):
        folder = tmp_path / f"run-s{s}"
        folder.mkdir()
        history = [{"epoch": i + 1, "seconds": v} for i, v in enumerate(seconds)]
        (folder / "host.json").write_text(json.dumps({"epochs": history}))
        folders.append(folder)
    path = tmp_path / "phases.json"
    if phases is not None:
        path.write_text(json.dumps(phases))
    return SimpleNamespace(folders=folders, phases=path, t0=100.0)


def test_a_job_without_phases_splits_into_its_steps_and_the_rest(tmp_path):
    assert breakdown(job(tmp_path, None), {"wall": 20.0, "end": 120.0}) == {
        "steps": 9.0,
        "rest": 11.0,
    }


def test_a_profiled_job_splits_into_start_phases_exit_and_other(tmp_path):
    record = {
        "start": {"unix": 103.0},
        "end": {"unix": 118.5},
        "phases": {"data": {"wall_s": 2.0}, "steps": {"wall_s": 9.0}, "outputs": {"wall_s": 1.0}},
    }
    parts = breakdown(job(tmp_path, record), {"wall": 20.0, "end": 120.0})
    assert parts["start"] == 3.0 and parts["exit"] == 1.5
    assert parts["data"] == 2.0 and parts["steps"] == 9.0 and parts["validation"] == 0.0
    assert set(PHASES) <= parts.keys()
    assert sum(parts.values()) == pytest.approx(20.0)  # "other": what no phase covers
    assert parts["other"] == pytest.approx(20.0 - 3.0 - 1.5 - 12.0)
