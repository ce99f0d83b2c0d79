"""Keep freed memory in the training process instead of handing it back to the OS.

glibc's malloc returns memory to the OS when the free space at the top of its heap passes a
threshold (M_TRIM_THRESHOLD) and serves blocks above another one (M_MMAP_THRESHOLD, adjusted as
the process runs) by mmap, unmapping them when freed. A training step frees and allocates the
same activation buffers (12.8 MB each for the study classifier at batch 128) every step; once
they go back to the OS, every step faults their pages in again, and memory-bound kernels
(BatchNorm, max-pool, zeroing gradients) pay for it. Several runs in one process (a stack) hit
this where one run does not: their steps were 1.7x slower (bench/RESULTS.md). Fixing both
thresholds keeps the pages: the process's resident memory stays at its peak, which it reaches
anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
TRIM = 2**31 - 1  # mallopt takes a C int: 2 GiB of free heap top before any is returned
MMAP = 32 * 2**20  # the largest mmap threshold glibc accepts on 64-bit (half its heap size)


@functools.cache
def keep_freed_memory() -> bool:
    """Fix glibc's trim and mmap thresholds for this process (once); False where the C library
    is not glibc (macOS, musl) or refuses, and nothing changes."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP))
