"""The study's estimate (pipeline/study/estimate.py) and execute.py's critical-path order: the
simulated wall of constructed plans with answers worked out by hand, the order ready tasks
start in, and the verdict study's plan against its measured wall."""

import json
import sys
from pathlib import Path

import pytest

from pipeline.study.config import StudyError, Task
from pipeline.study.estimate import (
    EstimateError,
    critical_path,
    load_rates,
    measured_line,
    remaining_path,
    simulate,
    start_order,
)
from pipeline.study.execute import execute

VERDICT = Path(__file__).resolve().parent.parent / "docs" / "results" / "fashion-verdict"


def _dag() -> tuple[list[Task], dict[str, float]]:
    """a (1) -> b (10) -> c (10): the long chain, listed last; g1, g2, g3 (5 each) wait for a
    only. Plan order: a, g1, g2, g3, b, c."""
    tasks = [
        Task("a", []),
        Task("g1", [], {"a"}),
        Task("g2", [], {"a"}),
        Task("g3", [], {"a"}),
        Task("b", [], {"a"}),
        Task("c", [], {"b"}),
    ]
    return tasks, {"a": 1, "g1": 5, "g2": 5, "g3": 5, "b": 10, "c": 10}


def test_remaining_path_is_own_seconds_plus_the_longest_chain_of_dependants():
    tasks, sec = _dag()
    path = remaining_path(tasks, sec)
    assert path == {"a": 21, "g1": 5, "g2": 5, "g3": 5, "b": 20, "c": 10}
    assert critical_path(tasks, path) == ["a", "b", "c"]


def test_the_longest_path_starts_first_and_ties_keep_plan_order():
    tasks, sec = _dag()
    path = remaining_path(tasks, sec)
    ready = tasks[1:5]  # g1, g2, g3, b
    assert [t.name for t in start_order(ready, path)] == ["b", "g1", "g2", "g3"]
    assert [t.name for t in start_order(ready, None)] == ["g1", "g2", "g3", "b"]


def test_simulated_wall_of_a_constructed_plan_by_hand():
    """2 jobs. Plan order: a [0,1]; g1, g2 [1,6]; g3, b [6,16] and [6,11]; c [16,26]: 26 s.
    Critical path first: a; b, g1 at 1; g1 ends 6, g2 [6,11]; b ends 11, c [11,21], g3
    [11,16]: 21 s, the critical path's own length (nothing waits beyond it)."""
    tasks, sec = _dag()
    plan_order = simulate(tasks, sec, jobs=2)
    assert plan_order.wall == 26
    assert plan_order.starts == {"a": 0, "g1": 1, "g2": 1, "g3": 6, "b": 6, "c": 16}
    critical = simulate(tasks, sec, jobs=2, priority=remaining_path(tasks, sec))
    assert critical.wall == 21
    assert critical.starts["c"] == 11
    # one job: the sum of the seconds, whatever the order; many jobs: the critical path
    assert simulate(tasks, sec, jobs=1).wall == sum(sec.values())
    assert simulate(tasks, sec, jobs=8).wall == 21


def test_done_tasks_cost_nothing_and_a_plan_waiting_outside_itself_is_one_error():
    tasks, sec = _dag()
    tasks[0].done = tasks[4].done = True  # a and b done: g1, g2 [0,5]; g3, c [5,10], [5,15]
    schedule = simulate(tasks, sec, jobs=2)
    assert schedule.wall == 15 and "a" not in schedule.starts
    assert schedule.starts == {"g1": 0, "g2": 0, "g3": 5, "c": 5}
    with pytest.raises(StudyError, match="outside the plan: \\['x'\\]"):
        simulate([Task("y", [], {"x"})], {"y": 1}, jobs=1)


def _sleep(name: str, seconds: float, after: set[str] = frozenset()) -> Task:
    """A task whose one command sleeps (no stage runs): a `python -c` step."""
    task = Task(name, [("-c", [f"import time; time.sleep({seconds})"])], set(after))
    task.commands = lambda preset, extra=(): [[sys.executable, "-c", task.steps[0][1][0]]]
    return task


def test_execute_starts_the_longest_remaining_path_first(tmp_path):
    """execute with priorities: of the ready g (short) and b (with a dependant), b starts
    first although the plan lists it last; the order is in the study's log."""
    tasks = [_sleep("a", 0), _sleep("g", 0), _sleep("b", 0, {"a"}), _sleep("c", 0, {"b"})]
    tasks[1].after = {"a"}
    sec = {"a": 1, "g": 5, "b": 10, "c": 10}
    started: list[str] = []
    execute(
        tasks, "digits", 1, tmp_path, lambda s: started.append(list(s)[-1]),
        remaining_path(tasks, sec),
    )  # fmt: skip
    assert started == ["a", "b", "c", "g"]
    started.clear()
    for t in tasks:
        (tmp_path / f"{t.name}.log").unlink()
    execute(tasks, "digits", 1, tmp_path, lambda s: started.append(list(s)[-1]))
    assert started == ["a", "g", "b", "c"]  # no priorities: plan order, as before


def test_rates_file_errors_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("SEMIX_STUDY_RATES", str(tmp_path / "none.json"))
    with pytest.raises(EstimateError, match="cannot read the study's rates file .*none.json"):
        load_rates()
    (tmp_path / "r.json").write_text(json.dumps({"rates": {"prepare": 1}}))
    with pytest.raises(EstimateError, match="no rate for chain, evaluate, finetune"):
        load_rates(tmp_path / "r.json")


def test_measured_line_says_the_difference_in_percent():
    assert measured_line(3600, 3960).endswith("against the estimate's 1 h 00 min (+10 %)")


def test_committed_rates_name_their_source():
    rates = load_rates()
    assert "fashion-verdict/host.json" in rates["source"]
    assert all(v >= 0 for v in rates["rates"].values())


@pytest.mark.slow
def test_the_verdict_plan_is_estimated_within_15_percent_of_its_measured_wall(tmp_path):
    """The verdict study's plan rebuilt from its config (the study's defaults at fashion-mnist,
    2 jobs), estimated with the committed rates (fitted on that study's own task seconds, not
    its wall): within 15 % of the wall its host.json measured, 8,010 + 52 + 5,947 s; and with
    rates from sitting 1 alone (blind to the 101 tasks of sitting 3) within 15 % too."""
    from pipeline.study.estimate import estimate, rates_from_host, sittings
    from pipeline.study.plan import setup

    host = json.loads((VERDICT / "host.json").read_text())
    wall = sum(s["wall_seconds_this_invocation"] for s in sittings(host))
    assert round(wall) == 14009
    cfg, root, tasks = setup("fashion-mnist", [f"out={tmp_path}"], data=False)
    assert len(tasks) == 280 and cfg.jobs == 2
    e = estimate(tasks, "fashion-mnist", cfg.jobs, root, order="plan")
    assert abs(e.wall - wall) / wall < 0.15
    first = rates_from_host(host, tasks, "fashion-mnist", 234.0, use=lambda i: i == 0)
    blind = estimate(tasks, "fashion-mnist", cfg.jobs, root, first, order="plan")
    assert abs(blind.wall - wall) / wall < 0.15
    assert critical_path(tasks, remaining_path(tasks, e.seconds))[:2] == ["prepare", "generator"]
