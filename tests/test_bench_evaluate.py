"""bench/bench_evaluate.py's agreement check (the timing itself is never run in tests)."""

from __future__ import annotations

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
