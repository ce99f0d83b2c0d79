"""Logs (issue 31, item 5): one "done" line per run, from global rank 0 only; off a terminal,
progress lines at most one per 10 % step and never two within 30 s (a one-second prepare used
to write ten), with a line still after every `every` seconds of a slow loop."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

import pipeline.cli
from core.logs import PROGRESS_GAP_S, LogProgress, setup_logging
from pipeline.cli import main


@pytest.mark.parametrize(("rank", "lines"), [("0", 1), ("1", 0), (None, 1)])
def test_done_is_printed_once_per_run_by_rank_0(rank, lines, capsys, monkeypatch):
    """Every rank of a launch returns from the stage; only global rank 0 (RANK, unset for a
    plain process) says so."""
    monkeypatch.setattr(pipeline.cli, "run_stage", lambda *a: Path("runs/digits/real"))
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    assert main(["prepare", "--preset", "digits"]) == 0
    out = capsys.readouterr().out
    assert out.count("semix prepare: done -> runs/digits/real") == lines, out


def logged(capsys, steps: list[tuple[float, int]], total: int | None, every: float = 60) -> list:
    """(time, n) of each line a LogProgress writes for `steps` of (seconds, items) on a fake
    clock, closed at the end."""
    setup_logging()
    now = [0.0]
    bar = LogProgress(None, total=total, desc="x", unit="it", every=every, clock=lambda: now[0])
    shown = []
    original = bar._line

    def line(at: float) -> None:
        shown.append((at, bar.n))
        original(at)

    bar._line = line  # type: ignore[method-assign]
    for seconds, n in steps:
        now[0] += seconds
        bar.update(n)
    bar.close()
    capsys.readouterr()
    return shown


def test_a_fast_loop_logs_only_its_last_line(capsys):
    """100 items in 1 s: every 10 % step comes within the first 30 s, so only close writes."""
    assert logged(capsys, [(0.01, 1)] * 100, total=100) == [(pytest.approx(1.0), 100)]


def test_steps_of_10_percent_are_kept_30_s_apart(capsys):
    """100 items, 1 s each: 10 % every 10 s; lines at the first new step 30 s after the last
    line (30, 60, 90 items), then the end."""
    shown = logged(capsys, [(1.0, 1)] * 100, total=100)
    assert [n for _, n in shown] == [30, 60, 90, 100]
    times = [0.0, *(t for t, _ in shown[:-1])]  # from the start; the last line is close's
    assert all(b - a >= PROGRESS_GAP_S for a, b in itertools.pairwise(times))


def test_a_slow_loop_logs_each_10_percent(capsys):
    """10 items, 100 s each: every item is a new 10 % step, far apart: a line each."""
    assert [n for _, n in logged(capsys, [(100.0, 1)] * 10, total=10)] == list(range(1, 11))


def test_a_loop_slower_than_10_percent_a_minute_still_logs_every_minute(capsys):
    """1,000 items, one per 20 s (10 % = 33 min): a line each `every` (60) seconds anyway."""
    shown = logged(capsys, [(20.0, 1)] * 30, total=1000)
    assert [round(t) for t, _ in shown] == [60, 120, 180, 240, 300, 360, 420, 480, 540, 600]
