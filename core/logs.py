"""What semix tells the person running it: its logger, and the progress of long loops.

Log lines go to stderr through `tqdm.write`, so they never share a line with a progress bar.
Progress shows as SEMIX_PROGRESS says: tqdm bars on a terminal; elsewhere (a file, a pipe, a job
log) a log line at each 10 % and after SEMIX_PROGRESS_EVERY seconds without one, never two
within 30 s (a one-second loop logs only its last line); or nothing.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")
log = logging.getLogger("semix")


class _StderrHandler(logging.Handler):
    """Writes to whatever sys.stderr is *now* (pytest and notebooks swap it), not at setup, and
    through `tqdm.write`: a progress bar being drawn is cleared first and redrawn under the
    line, so a log line never shares a line with a bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
            sys.stderr.flush()
        except RecursionError:  # as logging.StreamHandler does
            raise
        except Exception:  # logging's contract: a failed emit is reported, never raised
            self.handleError(record)


def setup_logging(is_main: bool = True) -> None:
    """semix's own logger only: other libraries keep their logging as they configured it."""
    level = logging.INFO if is_main else logging.WARNING
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s semix %(message)s", datefmt="%H:%M:%S"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(level)


# How progress shows (SEMIX_PROGRESS): "bar" = tqdm bars (they redraw one line with '\r': for a
# terminal), "log" = plain log lines (for a file, a pipe, a job log), "off"; "auto" = bars when
# stderr is a terminal or a notebook, log lines otherwise. SEMIX_NO_PROGRESS=1 is "off".
PROGRESS_MODES = ("auto", "bar", "log", "off")
# "log": a line at every 10 % and at least every this many seconds (SEMIX_PROGRESS_EVERY) ...
PROGRESS_EVERY_S = 60.0
# ... but never two lines this close: a fast loop (a 1-second prepare) is not worth ten lines
PROGRESS_GAP_S = 30.0
RATE_WINDOW_S = 1.0  # a line shows a rate only over at least this long since the line before
# tqdm's default bar without its `<remaining` (progress(eta=False)); its postfix keeps its ", "
NO_ETA_BAR = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]"


def progress_mode(stream: Any = None) -> str:
    """How progress written to `stream` (default: sys.stderr now) shows: bar, log or off."""
    if os.environ.get("SEMIX_NO_PROGRESS") == "1":
        return "off"
    mode = os.environ.get("SEMIX_PROGRESS", "auto").strip().lower() or "auto"
    if mode not in PROGRESS_MODES:
        raise ValueError(f"SEMIX_PROGRESS={mode!r}: choose one of {', '.join(PROGRESS_MODES)}")
    if mode != "auto":
        return mode
    stream = sys.stderr if stream is None else stream
    try:
        terminal = bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        terminal = False
    notebook = type(stream).__module__.startswith("ipykernel")  # Jupyter's stderr
    return "bar" if terminal or notebook else "log"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class LogProgress:
    """Progress as log lines, for a stderr that is no terminal (a file, a pipe, a job log):

        generate: 120/720 img (16 %), 3.1 img/s, ~3 min left

    one at every 10 % and at least every `every` seconds while work goes on, never two within
    `gap` seconds (counted from the start too), and a last one at the end; the rate is over the
    time since the line before (a skip ahead, as when a resumed stage counts its complete
    shards, shows no rate). Never a bar frame (carriage returns). `eta=False`: no time left
    from the count (a caller whose items differ in cost, the study's tasks, says its own in the
    postfix).
    It answers what the stages ask of a tqdm bar: iteration, `update(n)`, `set_postfix(...)`,
    `set_postfix_str(...)`, `close()`, `with`."""

    def __init__(
        self,
        iterable: Iterable[T] | None,
        *,
        total: int | None,
        desc: str,
        unit: str,
        every: float = PROGRESS_EVERY_S,
        gap: float = PROGRESS_GAP_S,
        clock: Callable[[], float] = time.monotonic,
        eta: bool = True,
    ) -> None:
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.every, self.gap, self.clock, self.eta = every, gap, clock, eta
        self.n, self.postfix = 0, ""
        self._mark = (clock(), 0)  # (time, n) of the last line: the rate's window
        self._shown = 0  # n of the last line
        self._tenth = 0  # last 10 % step shown

    def __iter__(self) -> Iterator[T]:
        for item in self.iterable or ():
            yield item
            self.update(1)

    def __enter__(self) -> LogProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        tenth = 10 * self.n // self.total if self.total else 0
        since = now - self._mark[0]
        if (tenth > self._tenth or since >= self.every) and since >= self.gap:
            self._tenth = max(tenth, self._tenth)
            self._line(now)

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{k} {v}" for k, v in values.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = str(s)  # tqdm's signature; a line shows it when it is next written

    def close(self) -> None:
        if self.n != self._shown:
            self._line(self.clock())

    def _line(self, now: float) -> None:
        done = f"{self.n}/{self.total} {self.unit}" if self.total else f"{self.n} {self.unit}"
        if self.total:
            done += f" ({100 * self.n // self.total} %)"
        parts = [done]
        seconds, count = now - self._mark[0], self.n - self._mark[1]
        if seconds >= RATE_WINDOW_S and count > 0:
            rate = count / seconds
            parts.append(
                f"{rate:.0f} {self.unit}/s" if rate >= 100 else f"{rate:.3g} {self.unit}/s"
            )
            if self.eta and self.total and self.n < self.total:
                parts.append(f"~{_duration((self.total - self.n) / rate)} left")
        if self.postfix:
            parts.append(self.postfix)
        log.info("%s: %s", self.desc, ", ".join(parts))
        self._mark, self._shown = (now, self.n), self.n


def progress(
    iterable: Iterable[T],
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    enabled: bool = True,
    eta: bool = True,
) -> Any:
    """A loop's progress, on the main process only (`enabled`), as SEMIX_PROGRESS says
    (`progress_mode`): a tqdm bar with rates on a terminal, a `LogProgress` line now and then
    elsewhere, nothing with SEMIX_PROGRESS=off (or SEMIX_NO_PROGRESS=1). Either way it is used
    as a tqdm bar: iterate it, `update(n)`, `set_postfix(...)`, `set_postfix_str(...)`, `with`.
    `eta=False`: neither shows a time left extrapolated from the count (the caller's postfix
    says it: items of unequal cost)."""
    mode = progress_mode() if enabled else "off"
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    if mode == "log":
        every = os.environ.get("SEMIX_PROGRESS_EVERY", str(PROGRESS_EVERY_S))
        try:
            seconds = float(every)
        except ValueError:
            raise ValueError(f"SEMIX_PROGRESS_EVERY={every!r}: a number of seconds") from None
        return LogProgress(iterable, total=total, desc=desc, unit=unit, every=seconds, eta=eta)
    return tqdm(
        iterable, total=total, desc=desc, unit=unit, disable=mode == "off", dynamic_ncols=True,
        **({} if eta else {"bar_format": NO_ETA_BAR}),
    )  # fmt: skip
