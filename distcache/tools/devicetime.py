"""What a device's work takes, apart from the host's: the timer of `python -m distcache
calibrate`'s kernels on a GPU.

A small step on a GPU is bound by its host: the launches of a cache's scheduler or of one
embedding lookup take longer to issue than the device takes to run them. Events recorded
around such a step measure the host's pace, and a step whose first calls compile or capture
CUDA graphs measures that too. The cost model prices the device's work (the launches are priced
apart, per layer and per step), so the calibration times it as the device sees it: a spin kernel
(`torch.cuda._sleep`) holds the stream while the host queues the whole step behind it, and the
events between the spin's end and the step's last kernel time the device's work alone. A call
whose host takes more than half the spin (it waited on the device, or the spin was too short)
is timed again with a longer spin (`device_seconds`) or reported as not covered
(`DeviceClock.time`).
On CPU the device is the host: the wall clock.

Example::

    seconds = device_seconds(lambda: kernel(ids, offsets).sum().backward(), device, repeats=5)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

_SPIN_CYCLES = (1 << 20, 1 << 23)  # two spins whose difference gives the seconds per cycle
_MIN_COVER_S = 1e-3  # the shortest spin: the host's first launches
_MAX_COVER_S = 2.0  # the longest: a step whose host takes longer is timed as it runs
_ATTEMPTS = 3  # spins tried for one repeat, each four times the last call's host time


class DeviceClock:
    """Times calls by the device's work on `device` (the wall clock on CPU)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._s_per_cycle = _spin_rate(self.device) if self._cuda else 0.0
        self.cover_s = _MIN_COVER_S
        """How long the next call's spin holds the stream."""

    def time(self, fn: Callable[[], object]) -> tuple[float, bool]:
        """(seconds of the device's work of `fn()`, whether the spin covered the host's
        queueing of it, with room to spare). On CPU: (wall seconds, True). The spin for the
        next call is four times this call's host time (at least `_MIN_COVER_S`, at most
        `_MAX_COVER_S`)."""
        if not self._cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start, True
        cover = self.cover_s
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
            torch.cuda._sleep(max(1, int(cover / self._s_per_cycle)))
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            host = time.perf_counter()
            fn()
            host = time.perf_counter() - host
            end.record()
            end.synchronize()
        self.cover_s = min(_MAX_COVER_S, max(_MIN_COVER_S, 4 * host))
        # The spin ran for `cover` from about when it was queued: a host done queueing within
        # half of it left the device no gap (a host that waited on the device took all of it).
        return start.elapsed_time(end) / 1e3, host < cover / 2


def device_seconds(
    fn: Callable[[], object], device: torch.device | str, repeats: int, *, warmup: int = 3
) -> float:
    """Median seconds of the device's work of `fn()` over `repeats` calls, after `warmup`
    calls (a cache of distcache's compiles and captures its graphs in its first two), each
    timed by a `DeviceClock`: on CPU the wall clock.

    A repeat the spin did not cover is timed again with a longer one, up to `_ATTEMPTS`
    times; after that (a step that waits on the device) its last timing counts as it is.
    """
    clock = DeviceClock(device)
    for _ in range(warmup):
        clock.time(fn)  # (sizes the spin to the host's time)
    times = []
    for _ in range(repeats):
        for _ in range(_ATTEMPTS):
            seconds, covered = clock.time(fn)
            if covered:
                break
        times.append(seconds)
    return max(statistics.median(times), 1e-9)


def _spin_rate(device: torch.device) -> float:
    """Seconds per cycle of `torch.cuda._sleep` on `device`, timed at two lengths."""
    with torch.cuda.device(device):
        measured = []
        for cycles in (*_SPIN_CYCLES, *_SPIN_CYCLES):  # each twice: the first warms up
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            measured.append(start.elapsed_time(end) / 1e3)
    short, long = measured[2:]
    return max((long - short) / (_SPIN_CYCLES[1] - _SPIN_CYCLES[0]), 1e-12)
