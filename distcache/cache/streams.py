"""`Streams`: the streams and events one cache orders its work with; no-ops on CPU.

On CUDA a cache uses three streams:
- the *compute* stream (the caller's current stream): lookups, backward, the optimizer;
- the *schedule* stream: the scheduler's bookkeeping and the plans (`Scheduler`), which depend on
  the ids (produced on the compute stream) and on releases (after a backward);
- the *staging* stream: the stager's copies between the host store and the cache.

They are ordered by events only, never by the host waiting, except in the stager's worker thread,
whose job is to wait. On CPU every method below does nothing (or the plain thing), so the same
code runs on both and CI exercises it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch


class Streams:
    """The schedule and staging streams of a cache on `device` (none on CPU)."""

    # A batch switches streams and records events several times on the training thread, and
    # the host is what bounds a step on a GPU: the device is named by its index, for which
    # torch's stream calls skip their device lookup (with a `torch.device` or none, each call
    # asked whether CUDA is available, environment included: 0.3-0.5 ms a step on an H200).
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.index = _index(device) if self.cuda else None
        self.schedule = torch.cuda.Stream(device) if self.cuda else None
        self.staging = torch.cuda.Stream(device) if self.cuda else None

    def current(self) -> torch.cuda.Stream:
        """The current stream of this cache's device (CUDA)."""
        return torch.cuda.current_stream(self.index)

    def on(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[None]:
        """Make `stream` current (CUDA); nothing on CPU."""
        return stream_on(stream, self.index)

    def record(
        self, stream: torch.cuda.Stream | None = None, *, host: bool = False
    ) -> torch.cuda.Event | None:
        """An event after the work queued so far on `stream` (default: the current stream).
        `host`: a host thread will wait for it (`host_wait`), sleeping rather than spinning."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(blocking=host)
        event.record(stream or self.current())
        return event

    def wait(self, event: torch.cuda.Event | None, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: current) wait for `event` on the device; the host goes on."""
        if event is not None:
            (stream or self.current()).wait_event(event)

    def host_wait(self, event: torch.cuda.Event | None) -> None:
        """Block this host thread until `event` completed (only the stager's worker does)."""
        if event is not None:
            event.synchronize()

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor for asynchronous copies (pinned on CUDA)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def keep_for(self, tensor: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        """`tensor`, allocated on another stream, is used on `stream`: keep its memory until
        that use completed."""
        if stream is not None and tensor.is_cuda:
            tensor.record_stream(stream)


def current_on(device: torch.device) -> torch.cuda.Stream:
    """The current stream of CUDA `device`, named by its index (`Streams`)."""
    return torch.cuda.current_stream(_index(device))


def tensors_in(value: object) -> Iterator[torch.Tensor]:
    """Every tensor in `value`: a tensor, or dataclasses, tuples, lists and dicts of them,
    nested (what a batch's routed parts and a sharded module's context hold)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors_in(getattr(value, field.name))
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


def keep_all_for(value: object, stream: torch.cuda.Stream) -> None:
    """`Streams.keep_for` of every CUDA tensor in `value` (`tensors_in`)."""
    for tensor in tensors_in(value):
        if tensor.is_cuda:
            tensor.record_stream(stream)


def _index(device: torch.device) -> int:
    """A CUDA device's index (the current device's where it names none)."""
    return torch.cuda.current_device() if device.index is None else device.index


@contextlib.contextmanager
def stream_on(stream: torch.cuda.Stream | None, index: int | None) -> Iterator[None]:
    """`torch.cuda.stream(stream)` for a stream of device `index`, without its device lookups
    where that device is the current one (`Streams`); nothing where `stream` is None."""
    if stream is None:
        yield
        return
    if torch.cuda.current_device() != index:  # (torch's context switches the device too)
        with torch.cuda.stream(stream):
            yield
        return
    before = torch.cuda.current_stream(index)
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(before)


def mirror(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s values on the host, for reading later without waiting: an asynchronous copy
    into a pinned host buffer on CUDA (queued on the current stream; read it after an event
    recorded there); on CPU the tensor itself, already on the host (its makers never write it
    again: plans, counts and check words are fresh tensors)."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


class HostCopy:
    """An asynchronous copy of a small device tensor to the host, read later.

    Made where the tensor is computed; `read()` returns its values, waiting only if the copy has
    not completed yet (in a pipeline it was queued batches before, so it has).
    """

    def __init__(self, tensor: torch.Tensor):
        self._host = mirror(tensor)
        self._event = torch.cuda.Event() if tensor.is_cuda else None
        if self._event is not None:  # (by index: `Streams`)
            self._event.record(torch.cuda.current_stream(tensor.device.index))

    def read(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._host.numpy().tolist()

    def read_if_done(self) -> list | None:
        """Its values if the copy has completed, else None: never waits (on CPU, always
        done)."""
        if self._event is not None and not self._event.query():
            return None
        return self._host.numpy().tolist()


class DeviceInts:
    """Small int64 tensors on a device made from host ints, kept per value: building one with
    `torch.tensor(ints, device=cuda)` copies from pageable host memory, which makes the host
    wait for the device, so each distinct value is built once (a batch's per-feature table
    sizes, strides or dims repeat from batch to batch). At most `limit` values are kept."""

    def __init__(self, limit: int = 256):
        self.limit = limit
        self._kept: dict[tuple, torch.Tensor] = {}

    def __call__(self, ints: list[int] | tuple[int, ...], device: torch.device) -> torch.Tensor:
        key = (tuple(ints), device)
        tensor = self._kept.get(key)
        if tensor is None:
            if len(self._kept) >= self.limit:
                self._kept.clear()
            tensor = self._kept[key] = torch.tensor(key[0], dtype=torch.int64, device=device)
        return tensor
