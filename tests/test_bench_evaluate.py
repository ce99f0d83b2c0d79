"""bench/bench_evaluate.py's agreement check and its shares (the timing itself is never run in
tests; the shares' evaluate once, on a tiny root, in the slow tier)."""

from __future__ import annotations

import pytest

from bench.bench_evaluate import _compare, _leaves


def test_leaves_flatten_every_number_and_skip_the_rest():
    tree = {"a": {"b": 1, "c": [2.5, {"d": 3}]}, "s": "text", "t": True, "n": None}
    assert _leaves(tree) == {"a.b": 1.0, "a.c[0]": 2.5, "a.c[1].d": 3.0}


def test_compare_names_the_sections_above_the_tolerance():
    before = {
        "posthoc.after.dirichlet.ece": 3.0,
        "posthoc.after.dirichlet.nll": 0.5,
        "posthoc.after.vector.ece": 2.0,
        "posthoc.val_nll.dirichlet": 0.3,
        "gone": 1.0,
    }
    now = dict(
        before, **{"posthoc.after.dirichlet.ece": 3.02, "posthoc.val_nll.dirichlet": 0.30005}
    )
    now.pop("gone")
    worst, off = _compare(before, now)
    assert abs(worst - 0.02) < 1e-12
    assert off == ["posthoc.after.dirichlet (1 keys, max 2.0e-02)", "gone (one side only)"]
    assert _compare(before, dict(before)) == (0.0, [])


def test_every_part_timed_is_a_function_of_this_checkout():
    import importlib

    from bench.bench_evaluate import PARTS

    for module, name, _ in PARTS:
        assert callable(getattr(importlib.import_module(module), name)), (module, name)


def test_shares_are_percentages_of_the_process_cpu_time():
    from bench.bench_evaluate import _shares

    text = _shares({"total": 40.0, "logits": 24.0, "splits read": 4.0})
    assert text == "logits 60 %, splits read 10 %, the rest 30 % of 40.0 CPU s"


@pytest.mark.slow
def test_shares_code_times_a_real_evaluate(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from test_evaluate import constructed_root

    from bench import REPO
    from bench.bench_evaluate import SHARES_CODE

    root = constructed_root(tmp_path)
    args = ["evaluate", "--preset", "digits", "--set", f"out={root.parent}", "name=const"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SHARES_CODE, *args, "run=over", "stage_dir=train"],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("SHARES ")]
    cpu = json.loads(line.removeprefix("SHARES "))
    parts = {"logits", "splits read", "post-hoc fits", "reliability diagram"}
    assert set(cpu) == {"total", *parts} and all(cpu[p] > 0 for p in parts)
    assert sum(cpu[p] for p in parts) < cpu["total"]
    assert (root / "eval" / "train" / "over" / "metrics.json").is_file()
