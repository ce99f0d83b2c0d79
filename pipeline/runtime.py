"""Runtime services every stage shares: seeding, processes, progress, logging, version.

Reproducibility rule: every random draw comes from an explicit generator derived from
(run seed, key), never from global RNG state, so results do not depend on call order,
batch size, rank or resume point.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from tqdm.auto import tqdm

from pipeline import __version__

T = TypeVar("T")
log = logging.getLogger("semix")


def derive_seed(seed: int, *key: Any) -> int:
    """A 63-bit seed from (seed, key...): stable across runs, machines and Python versions."""
    payload = json.dumps([seed, *key], separators=(",", ":"), default=str).encode()
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little") & ((1 << 63) - 1)


def make_generator(seed: int, *key: Any, device: str | torch.device = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(derive_seed(seed, *key))


# ---------------------------------------------------------------- processes


class Processes:
    """Rank/world view of the current launch (single process, torchrun or accelerate launch).

    Uses accelerate's PartialState so that `accelerate launch` and `torchrun` are picked up
    the same way; a plain `python -m pipeline ...` is rank 0 of 1 without any process group.
    """

    def __init__(self, cpu: bool | None = None):
        from accelerate import PartialState

        # Without CUDA, accelerate must be told so: otherwise it ignores torchrun's ranks on a
        # CPU machine and every process believes it is rank 0.
        if cpu is None:
            cpu = not torch.cuda.is_available()
        self.state = PartialState(cpu=cpu)

    @property
    def rank(self) -> int:
        return self.state.process_index

    @property
    def world(self) -> int:
        return self.state.num_processes

    @property
    def is_main(self) -> bool:
        return self.state.is_main_process

    @property
    def device(self) -> torch.device:
        return self.state.device

    def owns(self, shard_index: int) -> bool:
        """Shard i belongs to rank i mod world (ARCHITECTURE §5)."""
        return shard_index % self.world == self.rank

    def my_shards(self, num_shards: int) -> list[int]:
        return [i for i in range(num_shards) if self.owns(i)]

    def barrier(self) -> None:
        if self.world > 1:
            self.state.wait_for_everyone()


# ---------------------------------------------------------------- progress and logging


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is *now* (pytest and notebooks swap it), not at setup."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass  # always the current sys.stderr


def setup_logging(is_main: bool = True) -> None:
    """semix's own logger only: other libraries keep their logging as they configured it."""
    level = logging.INFO if is_main else logging.WARNING
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s semix %(message)s", datefmt="%H:%M:%S"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(level)


def progress(
    iterable: Iterable[T],
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    enabled: bool = True,
) -> Iterator[T]:
    """tqdm with rates, shown on the main process only; SEMIX_NO_PROGRESS=1 hides it."""
    disable = not enabled or os.environ.get("SEMIX_NO_PROGRESS") == "1"
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=disable, dynamic_ncols=True)


@functools.cache
def code_version() -> str:
    """'0.1.0' plus the git commit when run from a checkout: recorded in every manifest."""
    repo = Path(__file__).resolve().parent.parent
    if (repo / ".git").exists():
        try:
            sha = subprocess.run(
                ["git", "rev-parse", "--short=12", "HEAD"],
                cwd=repo,
                capture_output=True,
                text=True,
                timeout=5,
                check=True,
            ).stdout.strip()
            return f"{__version__}+g{sha}"
        except (OSError, subprocess.SubprocessError):
            pass  # no git binary or not a repository: the version alone is still truthful
    return __version__


@contextlib.contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """Run the block with n torch threads on a CPU-only machine, then restore the old count
    (a chain runs several stages in one process)."""
    before = torch.get_num_threads()
    if n > 0 and not torch.cuda.is_available():
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
