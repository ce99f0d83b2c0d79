"""core/allocator.py: freed activation buffers stay in the process (no page faults next step)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import subprocess_env

PROBE = """
import os, sys
import torch
from core.allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
x = torch.ones(20 * 2**20 // 4)  # 20 MiB, touched: an activation buffer of a training step
held = rss()
del x
print(kept, (held - rss()) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_freed_buffers_stay_resident_only_when_asked():
    def freed(mode: str) -> tuple[str, float]:
        out = subprocess.run(
            [sys.executable, "-c", PROBE, mode],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        return out[0], float(out[1])

    kept, returned = freed("keep")
    if kept != "True":
        pytest.skip("the C library is not glibc")
    assert returned < 1.0  # MiB given back to the OS: none, the pages stay for the next step
    assert freed("default") == ("False", pytest.approx(20.0, abs=2.0))  # glibc's default
