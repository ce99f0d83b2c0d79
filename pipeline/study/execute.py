"""How `make study` runs its plan: tasks as subprocesses, `jobs` at a time, in dependency order,
and a failed sitting summed up in one short line.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from core.io import atomic_write_json, read_json
from core.logs import log, progress
from core.machine import this_machine
from pipeline.registry import STAGES, resolve_stage_config
from pipeline.study.config import StudyError, Task, cpu_count
from pipeline.study.schedule import held_cores, start_order, startable

# the progress line's time left: (finished tasks' seconds, running ones' so far, failed) -> words
TimeLeftLine = Callable[[Mapping[str, float], Mapping[str, float], Collection[str]], str]

FAILURES = "failures.log"  # in the study's logs/: every failed task, its cause and its log
LINE_CHARS = 300  # the sitting's last line, at most (the cause is cut to fit)


class TaskError(StudyError):
    """One task's command failed: `cause` is its own last line (the stage's one-line error)."""

    def __init__(self, task: str, rc: int, log_path: Path, cause: str):
        super().__init__(f"{task} failed (exit {rc}): {cause}; see {log_path}")
        self.cause = cause


def last_error(log_path: Path) -> str:
    """What a failed command said last: its `semix ...: error: ...` line where it printed one
    (a stage's bad input), else its last non-empty line (an exit code without a message)."""
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines()]
    except OSError:
        return "no log"
    lines = [line for line in lines if line]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or ["no output"])[-1]


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # the pools a command starts with


def task_env(cmd: list[str]) -> dict[str, str]:
    """The environment of one task command: this process's, with OpenMP's and MKL's pools
    started at the stage's `cpu_threads` when it pins one (train, evaluate, generate, annotate
    of the study's presets: 1), so that a command beside another one holds no thread it never
    uses (the stage's `torch.set_num_threads` caps its work; the pools are sized when the
    libraries load, before it). A chain (several stages, several counts) and a stage left at
    torch's default (0: every core) keep the environment as it is; a value the user set wins."""
    env = dict(os.environ)
    if cmd[1:3] != ["-m", "pipeline"] or len(cmd) < 7 or cmd[4] != "--preset":
        return env  # not a stage command (Task.commands' form): nothing to pin
    stage, preset = cmd[3], cmd[5]
    if stage not in STAGES or any(v in env for v in THREAD_VARS):
        return env
    try:
        threads = resolve_stage_config(stage, preset, cmd[7:]).cpu_threads
    except (ValueError, OSError):  # the stage itself reports a bad config, in its own log
        return env
    if threads > 0:
        env |= {v: str(threads) for v in THREAD_VARS}
    return env


def _execute(task: Task, preset: str, logs: Path) -> float:
    """Run the task's commands one after another, output to logs/<task>.log; seconds taken."""
    t0 = time.perf_counter()
    log_path = logs / f"{task.name}.log"
    try:
        extra = task.prepare() if task.prepare else []
    except (ValueError, OSError) as e:  # in this process: its log says so, as a command would
        with open(log_path, "a", encoding="utf-8") as out:
            out.write(f"{task.name}: preparing its command failed: {e}\n")
        raise TaskError(task.name, 1, log_path, f"preparing its command failed: {e}") from e
    if extra is None:  # nothing to run (a tuning extension its grid's choice does not need)
        with open(log_path, "a", encoding="utf-8") as out:
            out.write(f"{task.name}: nothing to run\n")
        return time.perf_counter() - t0
    for cmd in task.commands(preset, extra):
        with open(log_path, "a", encoding="utf-8") as out:
            out.write(f"$ {' '.join(cmd[1:])}\n")
            out.flush()
            rc = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=task_env(cmd)
            ).returncode
        if rc != 0:
            raise TaskError(task.name, rc, log_path, last_error(log_path))
    return time.perf_counter() - t0


def failure_line(failed: dict[str, str], first: str, total: int, logs: Path) -> str:
    """The sitting's last line (LINE_CHARS at most): how many tasks failed, the first failure's
    cause (cut to fit), its log, and the log that lists every failure."""
    head = f"{len(failed)} of {total} study tasks failed; first {first}: "
    tail = f" (its log: {logs / first}.log; every failure: {logs / FAILURES})"
    cause, room = failed[first], max(40, LINE_CHARS - len(head) - len(tail))
    if len(cause) > room:
        cause = cause[: room - 1] + "…"
    return head + cause + tail


class Sitting:
    """study/host.json: what this machine took for the tasks of this invocation (the seconds
    are this machine's: never in study.json), rewritten as each task ends so that a sitting cut
    short still says what it did, and every earlier invocation that ran tasks kept beside it (a
    study run over several sittings keeps each one's record). `machine` names the machine the
    seconds are (core.machine: CPU, family, bf16 capability, cores, torch), so rates fitted
    from them carry it (rates.py's `fit`) and an estimate elsewhere can say it is a guess."""

    def __init__(self, path: Path) -> None:
        self.path, self.t0 = path, time.perf_counter()
        self.machine = this_machine()
        self.started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            old = read_json(path)
        except (OSError, ValueError):
            old = {}
        self.earlier = old.get("earlier_invocations", [])
        self.estimate: dict | None = None  # the plan's estimate before the first task (estimate.py)
        if old.get("task_seconds_this_invocation"):
            self.earlier.append({k: v for k, v in old.items() if k != "earlier_invocations"})

    def wall(self) -> float:
        return time.perf_counter() - self.t0

    def write(self, seconds: dict[str, float], finished: bool = False) -> None:
        atomic_write_json(
            self.path,
            {
                "started": self.started,
                "code": code_version(),
                "cpu_count": os.cpu_count(),
                "machine": self.machine,
                "task_seconds_this_invocation": seconds,
                "wall_seconds_this_invocation": round(time.perf_counter() - self.t0, 1),
                "finished": finished,
                **({"estimate": self.estimate} if self.estimate else {}),
                "earlier_invocations": self.earlier,
            },
        )


def code_version() -> str | None:
    """The commit of the code that ran (with "+changes" when its files differ from it); None
    outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def execute(
    tasks: list[Task],
    preset: str,
    jobs: int,
    logs: Path,
    on_done: Callable[[dict[str, float]], None] | None = None,
    priority: dict[str, float] | None = None,
    cpus: int | None = None,
    time_left: TimeLeftLine | None = None,
) -> dict[str, float]:
    """Run pending tasks in dependency order, at most `jobs` at a time and never more cores
    than the machine has (`cpus`, this machine's by default): a task holds its `cores`, and
    one that asks for every core runs alone, so that torch's OpenMP pool never waits on a
    thread the neighbour's process has descheduled (the generator fit ran at 0.54-0.60 step/s
    beside a one-thread task, 1.45 alone). When several are ready, the one with the longest
    remaining path (`priority`: its expected seconds plus its longest chain of dependants,
    estimate.remaining_path) starts first, so the generator fit and the chains that wait on
    it go before grids that can wait; ties, and no priorities, by plan order; the first that
    does not fit stops the others (schedule.startable: the same rule the estimate simulates).
    A failed task fails the tasks that need it; the others go on. Raises at the end in one
    short line (failure_line); every failure, its cause and its log in logs/failures.log.
    `on_done(seconds)` after each task that ran to the end. `time_left(finished, running,
    failed)` (time_left.TimeLeft.line: the finished tasks' seconds, the running ones' seconds so
    far, the failed ones) says the time left on the progress line as each task ends, in place
    of the line's count of runs per second (a 20-s evaluation is not a 20-min chain)."""
    cpus = cpus or cpu_count()
    logs.mkdir(parents=True, exist_ok=True)
    done = {t.name for t in tasks if t.done}
    pending = [t for t in tasks if not t.done]
    failed: dict[str, str] = {}  # task -> its cause, in the order they failed
    seen: dict[str, str] = {}  # task -> its log, for the ones that ran and failed
    seconds: dict[str, float] = {}
    running: dict[Future, Task] = {}
    started: dict[str, float] = {}  # a running task's start (perf_counter), for time_left
    with (
        ThreadPoolExecutor(jobs) as pool,
        progress(
            range(len(pending)),
            total=len(pending),
            desc="study",
            unit="run",
            eta=time_left is None,  # time_left says it, per kind of task
        ) as bar,
    ):
        while pending or running:
            for t in list(pending):  # in plan order: a skipped task skips its dependants
                if t.after & set(failed):
                    pending.remove(t)
                    failed[t.name] = f"skipped: needs {', '.join(sorted(t.after & set(failed)))}"
                    bar.update(1)
            ready = start_order([t for t in pending if t.after <= done], priority)
            busy = sum(held_cores(t, cpus) for t in running.values())
            for t in startable(ready, len(running), busy, jobs, cpus):
                pending.remove(t)
                running[pool.submit(_execute, t, preset, logs)] = t
                started[t.name] = time.perf_counter()
                log.info("study: started %s", t.name)
            if not running:
                if pending:  # a plan's own bug: its prerequisites are not in it
                    missing = sorted(set().union(*(t.after for t in pending)) - done)
                    raise StudyError(f"study tasks wait for tasks outside the plan: {missing}")
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in finished:
                t = running.pop(f)
                try:
                    seconds[t.name] = round(f.result(), 1)
                    done.add(t.name)
                    log.info("study: %s done in %.0f s", t.name, seconds[t.name])
                    if on_done is not None:
                        on_done(seconds)
                except StudyError as e:
                    failed[t.name] = getattr(e, "cause", str(e))
                    seen[t.name] = str(logs / f"{t.name}.log")
                    log.error("study: %s", e)
                if time_left is not None:
                    now = time.perf_counter()
                    so_far = {r.name: now - started[r.name] for r in running.values()}
                    bar.set_postfix_str(time_left(seconds, so_far, failed), refresh=False)
                bar.update(1)
    if failed:
        rows = [
            f"{k}: {v}" + (f" (log: {seen[k]})" if k in seen else "") for k, v in failed.items()
        ]
        (logs / FAILURES).write_text("\n".join(rows) + "\n", encoding="utf-8")
        first = next(iter(seen), next(iter(failed)))  # the first that ran and failed
        raise StudyError(failure_line(failed, first, len(tasks), logs))
    return seconds
