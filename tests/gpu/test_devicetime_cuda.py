"""`distcache.tools.devicetime` on a GPU: the device's work of a step is timed apart from its
host's, so that calibrate's figures are the device's (issue 35, item 1; CPU:
`tests/unit/tools/test_devicetime.py`)."""

from __future__ import annotations

import time

import pytest
import torch

from distcache.tools.devicetime import DeviceClock, device_seconds
from tests.gpu.common import CUDA_REASON

DEVICE = torch.device("cuda")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)


def _cycles(seconds: float) -> int:
    """`torch.cuda._sleep` cycles of about `seconds`."""
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    torch.cuda._sleep(1 << 24)
    end.record()
    end.synchronize()
    return int((1 << 24) * seconds / (start.elapsed_time(end) / 1e3))


def test_the_hosts_time_is_not_timed():
    x = torch.zeros(16, device=DEVICE)

    def step() -> None:  # the host busy 20 ms (as with many launches), the device 1 kernel
        time.sleep(0.02)
        x.add_(1)

    assert device_seconds(step, DEVICE, repeats=3) < 0.005


def test_the_devices_work_is_timed_in_full():
    cycles = _cycles(0.01)
    seconds = device_seconds(lambda: torch.cuda._sleep(cycles), DEVICE, repeats=3)
    assert 0.008 < seconds < 0.013


def test_a_step_that_waits_on_the_device_is_timed_as_it_runs():
    x = torch.zeros(16, device=DEVICE)
    clock = DeviceClock(DEVICE)
    seconds, covered = clock.time(lambda: x.add_(1).sum().item())  # the host waits: the spin
    assert not covered
    assert seconds > 0
