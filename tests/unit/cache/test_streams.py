"""`Streams`' CUDA calls, on a CPU: torch's CUDA stream API replaced by a recorder, so that the
stream switches and events a cache makes are checked where CI runs (the GPU tests run them for
real). The point of the checks: the stream is switched and put back, even when the work in
between raises, the device is named by its index (which spares torch's device lookup on every
call), and a switch to a stream of another device than the current one goes through
`torch.cuda.stream`, which switches the device too."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch

from distcache.cache import streams as streams_module
from distcache.cache.streams import Streams, stream_on


@dataclass(frozen=True)
class _Stream:
    name: str
    device_index: int

    def wait_event(self, event) -> None:  # noqa: ANN001
        event.waited_on.append(self.name)


class _Event:
    def __init__(self, blocking: bool = False):
        self.blocking, self.recorded_on, self.waited_on = blocking, [], []

    def record(self, stream: _Stream) -> None:
        self.recorded_on.append(stream.name)


class _FakeCuda:
    """What `Streams` calls of `torch.cuda`, recorded."""

    def __init__(self, device: int):
        self.device = device
        self.current = {device: _Stream("default", device)}
        self.made = 0
        self.calls: list[tuple] = []

    def Stream(self, device) -> _Stream:  # noqa: ANN001, N802
        self.made += 1
        return _Stream(f"side{self.made}", self.device if device.index is None else device.index)

    def current_device(self) -> int:
        return self.device

    def current_stream(self, device=None) -> _Stream:  # noqa: ANN001
        self.calls.append(("current_stream", device))
        return self.current[device]

    def set_stream(self, stream: _Stream) -> None:
        self.calls.append(("set_stream", stream.name))
        self.current[stream.device_index] = stream

    @contextlib.contextmanager
    def stream(self, stream: _Stream):
        self.calls.append(("torch.cuda.stream", stream.name))
        yield


@pytest.fixture
def cuda(monkeypatch) -> _FakeCuda:
    fake = _FakeCuda(device=1)
    for name in ("Stream", "current_device", "current_stream", "set_stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    return fake


def test_a_stream_switch_is_put_back_even_when_the_work_raises(cuda):
    s = Streams(torch.device("cuda", 1))
    assert s.index == 1
    with s.on(s.schedule):
        assert cuda.current[1] is s.schedule
    assert cuda.current[1].name == "default"
    with pytest.raises(RuntimeError, match="boom"), s.on(s.staging):
        raise RuntimeError("boom")
    assert cuda.current[1].name == "default"
    assert ("torch.cuda.stream", "side1") not in cuda.calls  # (the same device: no lookup)


def test_events_are_recorded_and_waited_on_the_current_stream_named_by_index(cuda):
    s = Streams(torch.device("cuda"))  # no index: the current device's
    assert s.index == 1
    event = s.record()
    with s.on(s.schedule):
        s.wait(event)
    s.wait(event, s.staging)
    assert event.recorded_on == ["default"] and event.waited_on == ["side1", "side2"]
    assert {device for call, device in cuda.calls if call == "current_stream"} == {1}
    assert s.record(host=True).blocking


def test_a_stream_of_another_device_switches_through_torch(cuda):
    other = _Stream("other", device_index=0)
    with stream_on(other, 0):
        pass
    assert cuda.calls == [("torch.cuda.stream", "other")]
    with stream_on(None, 1):  # nothing to switch to
        pass
    assert len(cuda.calls) == 1


def test_on_cpu_nothing_is_switched_or_recorded(monkeypatch):
    monkeypatch.setattr(streams_module.torch.cuda, "set_stream", None)  # never called
    s = Streams(torch.device("cpu"))
    with s.on(s.schedule):
        assert s.record() is None
    s.wait(None)


def test_tensors_in_finds_every_tensor_of_nested_batches_and_contexts():
    """`tensors_in` (what `keep_all_for` keeps for another stream): tensors in dataclasses,
    tuples, lists and dicts, nested, and nothing else."""

    @dataclass
    class _Part:
        ids: torch.Tensor
        extra: object = None

    a, b, c, d = (torch.full((2,), float(i)) for i in range(4))
    value = [_Part(a, extra=(b, {"k": _Part(c)})), None, "text", 3, (d,), _Part]
    assert [t[0].item() for t in streams_module.tensors_in(value)] == [0.0, 1.0, 2.0, 3.0]
    streams_module.keep_all_for(value, stream=None)  # CPU tensors: nothing to record
