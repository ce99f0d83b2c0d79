"""Where a training process's time goes, for the profiling bench (bench/bench_study_task.py).

    with phase("validation"):          # wall and CPU seconds of the block, added to its phase
        ...
    count("images_decoded", n)         # a counter beside the phases

With SEMIX_PHASES=<file>, a process adds up, per phase, its calls, wall seconds and CPU seconds
(every thread of the process: OpenMP workers spinning count too; the kernel's part apart), keeps counters (images
decoded, validations, checkpoint bytes) and the most threads the process held, and writes them
to <file> as JSON when it exits (temp + rename): start (the process's CPU and clock when the
stage began, imports included), the phases, the counters. Without it `phase` and `count` do
nothing but one dict lookup, and nothing is written: outputs never depend on it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ENV = "SEMIX_PHASES"  # the file a profiled process writes its phases to at exit


class _Record:
    """One process's phases and counters, written at exit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.phases: dict[str, dict[str, float]] = {}
        self.counts: dict[str, int] = {}
        self.threads = _threads()
        # the stage began now: what the process spent before (start, imports, config)
        self.start = {"unix": time.time(), **_cpu()}
        atexit.register(self.write)

    def add(self, name: str, wall: float, cpu: float, sys: float) -> None:
        p = self.phases.setdefault(name, {"calls": 0, "wall_s": 0.0, "cpu_s": 0.0, "sys_s": 0.0})
        p["calls"] += 1
        p["wall_s"] += wall
        p["cpu_s"] += cpu
        p["sys_s"] += sys
        self.threads = max(self.threads, _threads())

    def write(self) -> None:
        record = {
            "pid": os.getpid(),
            "start": self.start,
            "end": {"unix": time.time(), **_cpu()},
            "phases": {k: {f: round(v, 6) for f, v in p.items()} for k, p in self.phases.items()},
            "counts": self.counts,
            "threads_max": self.threads,
        }
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as e:  # the stage's work is done: one line, no traceback at exit
            print(f"semix: {ENV}={self.path}: not written ({e.strerror or e})", file=sys.stderr)


def _cpu() -> dict[str, float]:
    """CPU seconds of the whole process so far (every thread), and the kernel's part of them
    (page faults of freshly mapped tensors, file writes and fsyncs)."""
    t = os.times()
    return {"cpu_s": t.user + t.system, "sys_s": t.system}


def _threads() -> int:
    """Threads of this process now (Linux; 0 where /proc is not there)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


_record: _Record | None = None


def _active() -> _Record | None:
    """The process's record when SEMIX_PHASES is set (made on first use), else None."""
    global _record
    path = os.environ.get(ENV)
    if not path:
        return None
    if _record is None or _record.path != Path(path):
        _record = _Record(Path(path))
    return _record


def begin() -> None:
    """Mark the stage's start (the process's start and imports end here): first call wins."""
    _active()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the block's wall and CPU seconds to phase `name` (nothing without SEMIX_PHASES)."""
    record = _active()
    if record is None:
        yield
        return
    wall, cpu = time.perf_counter(), _cpu()
    try:
        yield
    finally:
        now = _cpu()
        record.add(
            name,
            time.perf_counter() - wall,
            now["cpu_s"] - cpu["cpu_s"],
            now["sys_s"] - cpu["sys_s"],
        )


def count(name: str, n: int = 1) -> None:
    """Add n to counter `name` (nothing without SEMIX_PHASES)."""
    record = _active()
    if record is not None:
        record.counts[name] = record.counts.get(name, 0) + int(n)


def snapshot() -> dict[str, Any] | None:
    """The record so far (tests), or None without SEMIX_PHASES."""
    record = _active()
    if record is None:
        return None
    return {"phases": dict(record.phases), "counts": dict(record.counts)}
