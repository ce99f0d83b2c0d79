"""bench/bench_plots.py's table (the timing itself is never run in tests; its chart process
once, one draw each, in the slow tier)."""

from __future__ import annotations

import pytest

from bench.bench_plots import ROWS, rows


def _side(scale: float) -> dict:
    chart = {"first": 0.5 * scale, "best": 0.1 * scale, "px": [960, 660], "bytes": 61_000}
    return {"import": 0.2 * scale, "reliability": chart, "lines": chart}


def test_rows_give_each_checkout_a_column_and_before_over_now_where_both_ran():
    table = rows({"before": _side(2.0), "now": _side(1.0)})
    assert [r["measure"] for r in table[: len(ROWS)]] == [what for what, _, _ in ROWS]
    assert table[0] == {
        "measure": "import matplotlib (cold, once)",
        "before": "400 ms",
        "now": "200 ms",
        "before / now": "2.00x",
    }
    assert table[-1]["now"] == "960x660 px, 61 kB"
    assert all(list(r) == list(table[0]) for r in table)  # one set of columns, in one order
    alone = rows({"now": _side(1.0)})
    assert list(alone[0]) == ["measure", "now"] and alone[2]["now"] == "100 ms"


@pytest.mark.slow
def test_the_chart_process_draws_every_chart_of_this_checkout(tmp_path):
    from bench import REPO
    from bench.bench_plots import measure

    out = measure(REPO, tmp_path / "now", repeats=1)
    assert out["import"] > 0
    assert out["reliability"]["px"] == [960, 660]
    assert all(out[c]["best"] > 0 and out[c]["bytes"] > 0 for c in ("reliability", "lines"))
