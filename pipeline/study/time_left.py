"""The study's time left, for its progress line (execute.py's `time_left`: TimeLeft.line): the
plan's estimate (estimate.py) simulated again over the tasks not yet finished, each kind's
expected seconds rescaled by what this machine measured of that kind so far (`correction`).
The estimate before the first task prices the plan at its rates file's machine's seconds; on
another CPU (the verdict's rates on a CPU without bf16: 3x the tuning runs' seconds) the first
finished tasks of a kind correct the rest of it, where the line's count of runs per second
would price a 20-s evaluation like a 20-min chain.

Apart from estimate.py, which it imports: the estimate is made once, before the first task;
this runs at every task's end, on what the sitting has measured since.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from pipeline.study.config import Task
from pipeline.study.estimate import KINDS, Estimate, hm
from pipeline.study.schedule import remaining_path, simulate

LEFT_EVERY_S = 60.0  # TimeLeft simulates at most this often (simulate: ~tasks² steps, ~0.1 s)


def correction(finished: Mapping[str, float], est: Estimate) -> dict[str, float]:
    """kind -> measured / estimated seconds of this invocation's `finished` tasks of that kind
    that ran (a task at 0 s ran nothing: a cell not kept, an extension not needed, as fit_rates
    counts them), each at its expected seconds before its share (Estimate.whole). A kind with
    nothing finished has no entry: it keeps its rate."""
    sums: dict[str, list[float]] = {}
    for name, measured in finished.items():
        if name not in est.works or measured <= 0 or est.whole(name) <= 0:
            continue
        total = sums.setdefault(est.works[name].kind, [0.0, 0.0])
        total[0] += measured
        total[1] += est.whole(name)
    return {kind: m / e for kind, (m, e) in sums.items()}


def _factors(factor: Mapping[str, float]) -> str:
    rows = [f"{kind} x{factor[kind]:.1f}" for kind in KINDS if kind in factor]
    return f"rates as measured here: {', '.join(rows)}" if rows else "the estimate's rates"


class TimeLeft:
    """The study's time left for its progress line (execute.py): the estimate's own simulation
    (schedule.simulate: the same priorities, `jobs` and core rule) over the tasks not finished,
    each kind's expected seconds times what this invocation measured of that kind against its
    estimate (`correction`), a running task's less the seconds it has run; not the line's runs
    per second, which prices a 20-s evaluation like a 20-min chain. On another CPU than the
    rates' (the verdict's rates on a CPU without bf16: 3x the tuning runs' seconds) the first
    finished tasks of a kind correct the rest of it. Simulates at most once every `every`
    seconds (the line asks at each task's end, ~250-500 times a study) and counts down from
    the last answer in between."""

    def __init__(
        self,
        tasks: Sequence[Task],
        est: Estimate,
        priority: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        every: float = LEFT_EVERY_S,
    ) -> None:
        self.tasks, self.est = list(tasks), est
        self.priority = priority if priority is not None else remaining_path(tasks, est.seconds)
        self.clock, self.every = clock, every
        self._last: tuple[float, float, str] | None = None  # (when, seconds left, its rates)

    def seconds_left(
        self,
        finished: Mapping[str, float],
        running: Mapping[str, float],
        dropped: Collection[str] = (),
    ) -> tuple[float, dict[str, float]]:
        """(the seconds left, the correction per kind): `finished` this invocation's task
        seconds, `running` the running tasks' seconds so far, `dropped` the tasks that failed
        (they and their dependants cost nothing more, as execute.py skips them). The report's
        seconds are added, uncorrected, while anything is left."""
        factor = correction(finished, self.est)
        failed = set(dropped)
        for t in self.tasks:  # plan order, a task after what it needs: one pass skips a chain
            if t.after & failed:
                failed.add(t.name)
        gone = set(finished) | failed
        seconds: dict[str, float] = {}
        under_way: dict[str, float] = {}
        for t in self.tasks:
            if t.done or t.name in gone:
                continue
            rescale = factor.get(self.est.works[t.name].kind, 1.0)
            if t.name in running:
                under_way[t.name] = max(0.0, self.est.whole(t.name) * rescale - running[t.name])
            else:
                seconds[t.name] = self.est.seconds[t.name] * rescale
        tasks = [dataclasses.replace(t, done=True) if t.name in gone else t for t in self.tasks]
        est = self.est
        wall = simulate(tasks, seconds, est.jobs, self.priority, est.cpus, under_way).wall
        return wall + (est.report if seconds or under_way else 0.0), factor

    def line(
        self,
        finished: Mapping[str, float],
        running: Mapping[str, float],
        dropped: Collection[str] = (),
    ) -> str:
        """`~3 h 10 min left (rates as measured here: train x2.9)`: seconds_left, simulated at
        most once every `every` seconds, counted down in between."""
        now = self.clock()
        if self._last is None or now - self._last[0] >= self.every:
            left, factor = self.seconds_left(finished, running, dropped)
            self._last = (now, left, _factors(factor))
        when, left, rates = self._last
        return f"~{hm(max(0.0, left - (now - when)))} left ({rates})"
