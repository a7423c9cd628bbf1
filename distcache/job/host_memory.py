"""Large host tensors reused, not page-faulted in again every step (glibc's allocator).

glibc serves an allocation of 32 MiB or more (its largest mmap threshold) with a fresh `mmap`
and unmaps it when it is freed, so a tensor of that size made every step (a collection's pooled
output at a large batch and dim, its gradient, an all-to-all's buffers) has every page of it
faulted in again, every step: on a CPU machine that can cost about as much as the all-to-all
that moves it (benchmarks/results/README.md, "Host memory of the ranks").

`keep_freed_memory` makes glibc serve every allocation from its heaps and keep what is freed
there for reuse (`mallopt`: no `mmap` for allocations, trimming only above 2 GiB free, and one
arena for every thread: a thread's own arena, 64 MiB at most, cannot hold such a tensor and
gives its memory back when it is freed): a process's memory then stays near its peak, as a
caching allocator's does, plus what fragmentation keeps (torch aligns its blocks, and a freed
block fits the next request of its size only once merged with a neighbour), a few hundred MiB
a rank in the runs of the results' README, steady once reached. distcache's CPU ranks call it
when they start (`run_ranks`' gloo workers, `process_group` on CPU: the training job,
`measure`, `calibrate`, the distributed tests and benchmarks; a GPU rank's big tensors live on
the device); `DISTCACHE_KEEP_FREED_MEMORY=0` leaves glibc's defaults. A process of your own
calls it once, first thing. It is a no-op off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_TRIM_BYTES = (1 << 31) - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Keep freed host memory for reuse instead of giving it back to the kernel (glibc);
    whether it took effect (False off glibc, or with DISTCACHE_KEEP_FREED_MEMORY=0)."""
    if os.environ.get("DISTCACHE_KEEP_FREED_MEMORY", "1") == "0":
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    settings = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_BYTES), (_M_ARENA_MAX, 1))
    return all(mallopt(param, value) == 1 for param, value in settings)


@functools.cache
def _mallopt():  # noqa: ANN202
    """glibc's `mallopt`, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt
