"""The study's scheduling rule, shared by what runs the plan (pipeline/study/execute.py) and what
estimates it (pipeline/study/estimate.py), so the estimate simulates the order the tasks really
start in: critical-path priority (`remaining_path`: a task's seconds plus its longest chain of
dependants), and the core rule (`startable`: a task starts only when its cores fit beside the
running ones; the first ready task that does not fit stops the list, so a wide task at the head
of the path is never starved).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline.study.config import StudyError, Task


def remaining_path(tasks: Sequence[Task], seconds: Mapping[str, float]) -> dict[str, float]:
    """Each task's expected seconds plus its longest chain of dependants: how long the study
    lasts past this task's start at the least, whatever the jobs. A task outside `seconds`
    costs 0. Dependants first (reverse topological order), so each task is visited once."""
    dependants: dict[str, list[str]] = {t.name: [] for t in tasks}
    for t in tasks:
        for a in t.after:
            if a in dependants:
                dependants[a].append(t.name)
    path: dict[str, float] = {}
    for name in reversed(_topological(tasks)):
        path[name] = seconds.get(name, 0.0) + max((path[d] for d in dependants[name]), default=0.0)
    return path


def _topological(tasks: Sequence[Task]) -> list[str]:
    """Plan order where it is a valid order (it is, for a plan built by plan.py); otherwise
    Kahn's order with ties by plan order. A cycle is a plan's bug: one line."""
    names = {t.name for t in tasks}
    indegree = {t.name: len(t.after & names) for t in tasks}
    dependants: dict[str, list[int]] = {t.name: [] for t in tasks}
    for i, t in enumerate(tasks):
        for a in t.after & names:
            dependants[a].append(i)
    ready = [i for i, t in enumerate(tasks) if indegree[t.name] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(tasks[i].name)
        for j in dependants[tasks[i].name]:
            indegree[tasks[j].name] -= 1
            if indegree[tasks[j].name] == 0:
                heapq.heappush(ready, j)
    if len(order) != len(tasks):
        raise StudyError(
            f"the study's tasks wait on each other in a cycle: {sorted(names - set(order))}"
        )
    return order


def start_order(ready: Sequence[Task], priority: Mapping[str, float] | None) -> list[Task]:
    """The order in which ready tasks start: the longest remaining path first, ties (and no
    priorities at all) by plan order. execute.py and simulate() both use it, so the estimate
    schedules as the study will."""
    if not priority:
        return list(ready)
    ranked = sorted(enumerate(ready), key=lambda it: (-priority.get(it[1].name, 0.0), it[0]))
    return [t for _, t in ranked]


def held_cores(task: Task, cpus: int | None) -> int:
    """The cores a task holds while it runs: its `cores`, the whole machine where it asks for
    every core or more (such a task runs alone); 0 without a core rule (`cpus` None)."""
    if cpus is None:
        return 0
    return cpus if task.cores <= 0 or task.cores >= cpus else task.cores


def startable(
    ready: Sequence[Task], running: int, busy: int, jobs: int, cpus: int | None
) -> list[Task]:
    """Which ready tasks start now, with `running` tasks holding `busy` cores: in `ready`'s
    order (start_order), while fewer than `jobs` run and the task's cores fit beside the busy
    ones on the machine's `cpus`. The first task that does not fit stops the list: nothing
    after it starts (it has the cores reserved as the running tasks end), so a task that needs
    the whole machine and heads the critical path is never starved by narrow tasks that keep
    starting beside each other. The price: a core can idle while the wide task waits for its
    neighbour to end. `cpus` None: no core rule (`jobs` only, the scheduler before it).
    execute.py and simulate() both use it."""
    out: list[Task] = []
    for t in ready:
        need = held_cores(t, cpus)
        if running + len(out) >= jobs or (cpus is not None and busy + need > cpus):
            break
        out.append(t)
        busy += need
    return out


@dataclass(frozen=True)
class Schedule:
    wall: float  # seconds from the first task's start to the last one's end
    starts: dict[str, float]  # every pending task's simulated start


def simulate(
    tasks: Sequence[Task],
    seconds: Mapping[str, float],
    jobs: int,
    priority: Mapping[str, float] | None = None,
    cpus: int | None = None,
    under_way: Mapping[str, float] | None = None,
) -> Schedule:
    """execute.py's loop with each task's expected seconds for its run: at each moment the
    ready tasks start as startable() lets them (start_order; fewer than `jobs` running; with
    `cpus`, the core rule); the earliest end frees its job and its cores (ends at the same
    moment together). A done task is done at 0. `under_way`: tasks already running (a study
    part way through: time_left.TimeLeft) and their seconds left; they hold their jobs and
    cores from 0, as they do in execute.py, and are not in `starts`."""
    under_way = under_way or {}
    done = {t.name for t in tasks if t.done}
    pending = [t for t in tasks if not t.done and t.name not in under_way]
    index = {t.name: i for i, t in enumerate(tasks)}
    held = {t.name: held_cores(t, cpus) for t in tasks}
    running = [(left, index[name], name) for name, left in under_way.items()]  # (end, index, name)
    heapq.heapify(running)
    starts: dict[str, float] = {}
    now, busy = 0.0, sum(held[name] for name in under_way)
    while pending or running:
        ready = start_order([t for t in pending if t.after <= done], priority)
        for t in startable(ready, len(running), busy, jobs, cpus):
            pending.remove(t)
            starts[t.name] = now
            busy += held[t.name]
            heapq.heappush(running, (now + seconds.get(t.name, 0.0), index[t.name], t.name))
        if not running:
            if pending:
                missing = sorted(set().union(*(t.after for t in pending)) - done)
                raise StudyError(f"study tasks wait for tasks outside the plan: {missing}")
            break
        now = running[0][0]
        while running and running[0][0] <= now:
            name = heapq.heappop(running)[2]
            done.add(name)
            busy -= held[name]
    return Schedule(now, starts)


def critical_path(tasks: Sequence[Task], path: Mapping[str, float]) -> list[str]:
    """The chain of dependants with the longest remaining path, from the pending task where it
    is longest: the wall no number of jobs gets below (ties by plan order)."""
    pending = [t for t in tasks if not t.done]
    dependants: dict[str, list[Task]] = {t.name: [] for t in tasks}
    for t in pending:
        for a in t.after:
            if a in dependants:
                dependants[a].append(t)
    chain: list[str] = []
    step = start_order(pending, path)[:1]
    while step:
        chain.append(step[0].name)
        step = start_order(dependants[step[0].name], path)[:1]
    return chain


# ---------------------------------------------------------------------------------------------
# 4. The estimate of a plan, its table and its record
