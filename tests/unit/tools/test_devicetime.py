"""`distcache.tools.devicetime` on CPU, where the device is the host: the wall clock, after the
warm-up calls (the GPU's own case: `tests/gpu/test_devicetime_cuda.py`)."""

import itertools
import time

from distcache.tools.devicetime import DeviceClock, device_seconds


def _slow_first(calls: int, slow_s: float, fast_s: float):
    """A step whose first `calls` calls take `slow_s` (a compile, a graph's capture), then
    `fast_s` each."""
    count = itertools.count()

    def step() -> None:
        time.sleep(slow_s if next(count) < calls else fast_s)

    return step


def test_the_warm_up_calls_are_not_timed():
    step = _slow_first(3, slow_s=0.2, fast_s=0.002)
    assert device_seconds(step, "cpu", repeats=3, warmup=3) < 0.05


def test_fewer_warm_up_calls_than_the_step_needs_time_its_slow_ones():
    step = _slow_first(3, slow_s=0.2, fast_s=0.002)
    assert device_seconds(step, "cpu", repeats=3, warmup=1) >= 0.2


def test_the_clock_on_cpu_is_the_wall_clock():
    seconds, covered = DeviceClock("cpu").time(lambda: time.sleep(0.02))
    assert covered
    assert 0.02 <= seconds < 0.2
