"""`GraphCache`: a function's device work captured once per key and replayed (`cuda_graphs`).

On CUDA a batch's routing and scheduling are a hundred-odd small kernels, and launching them
costs the host several microseconds each: more than the device needs to run them, so the host,
not the device, would set the pace. A CUDA graph launches them all at once. A graph replays the
kernels it recorded with the arguments it recorded, reading new values only from memory, so the
captured function must dispatch the same ops with the same host values for every call of a key
(for the scheduler, every batch of a size: `tests/unit/cache/test_replay.py`), take its inputs
from tensors the graph owns (copied in before each replay) and leave its Python state alone
(it runs once, at capture). Its results live in the graph's memory and are overwritten by the
next replay, so they are copied out.

On CPU there are no graphs; `CPUGraph` emulates one so that CI runs the same flow: the capture
runs the function once under a dispatch mode that records each op with its arguments, and a
replay dispatches the recorded ops again on the same tensors (an op's new result copied into
the tensor it made at capture). As on CUDA, Python code in the function runs once, host values
are baked in and every buffer keeps its place; it is slower than running the function, so it
is for tests.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distcache.errors import DistcacheConfigError

_log = logging.getLogger(__name__)

_replay = threading.local()


def replaying() -> bool:
    """Whether this thread is inside a `CPUGraph.replay` (for tools that count launches: on
    CUDA the replayed work is one graph launch, not dispatched ops)."""
    return getattr(_replay, "active", False)


class CPUGraph:
    """A CUDA graph's semantics on any device: capture records, replay re-dispatches."""

    executes_at_capture = True  # (a CUDA capture records without running)

    def __init__(self) -> None:
        self._ops: list[tuple] = []

    def capture(self, fn: Callable[..., tuple[torch.Tensor, ...]], *inputs: torch.Tensor):
        with _Recording(self._ops):
            return fn(*inputs)

    def replay(self) -> None:
        _replay.active = True
        try:
            for func, args, kwargs, made in self._ops:
                if func.is_view:  # the view made at capture still looks at the same memory
                    continue
                _into(made, func(*args, **kwargs))
        finally:
            _replay.active = False


class _Recording(TorchDispatchMode):
    def __init__(self, ops: list[tuple]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func._schema.name == "aten::_local_scalar_dense":
            raise DistcacheConfigError(
                "a captured function read a device value on the host (.item(), int(), ...): "
                "a graph cannot replay that"
            )
        made = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, made))
        return made


def _into(made: object, new: object) -> None:
    """Copy an op's result at replay into what it made at capture (in-place ops: the same)."""
    if isinstance(made, torch.Tensor):
        if not (
            new.data_ptr() == made.data_ptr()
            and new.shape == made.shape
            and new.stride() == made.stride()
        ):
            made.copy_(new)
    elif isinstance(made, (tuple, list)):
        for m, n in zip(made, new, strict=True):
            _into(m, n)


class CUDAGraph:
    """`torch.cuda.CUDAGraph` captured on the current stream (the scheduler's), or on torch's
    side stream where the current one is the default stream (CUDA captures nothing there: the
    module's routing runs on it); replayed on the stream current at the call."""

    executes_at_capture = False

    def __init__(self) -> None:
        self._graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[..., tuple[torch.Tensor, ...]], *inputs: torch.Tensor):
        # thread_local: the stager's worker may use the device meanwhile (other threads'
        # calls do not invalidate this capture).
        stream = torch.cuda.current_stream()
        if stream == torch.cuda.default_stream(stream.device):
            stream = None  # torch.cuda.graph's own side stream
        with torch.cuda.graph(self._graph, stream=stream, capture_error_mode="thread_local"):
            return fn(*inputs)

    def replay(self) -> None:
        self._graph.replay()


def padded_size(n: int) -> int:
    """`n` rounded up to one of four sizes per doubling (multiples of a quarter of the power of
    two below it; at least 16): calls whose sizes vary (jagged features) share a few captured
    graphs, for at most a quarter more items."""
    if n <= 16:
        return 16
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


@dataclass(frozen=True)
class _Layout:
    """Where a call's tensors sit in one flat buffer per dtype, in the order they come. A
    replayed call's inputs reach its graph in one copy per dtype, and its results leave it in
    one copy per dtype and come back as views of it by one split: a few host ops a call
    whatever the number of tensors (a byte buffer viewed back tensor by tensor took three
    ops each: 0.3 ms a step of an H200's host, 2026-11-28)."""

    dtypes: tuple[torch.dtype, ...]
    """The buffers', in order of first use."""
    places: tuple[tuple[int, int], ...]
    """Each tensor's buffer and its index among that buffer's tensors."""
    shapes: tuple[tuple[int, ...] | None, ...]
    """Each tensor's shape where it is not 1-D (flattened in its buffer)."""
    sizes: tuple[tuple[int, ...], ...]
    """Each buffer's tensors' sizes, in order."""

    @staticmethod
    def of(tensors: tuple[torch.Tensor, ...]) -> _Layout:
        dtypes: list[torch.dtype] = []
        sizes: list[list[int]] = []
        places = []
        for t in tensors:
            if t.dtype not in dtypes:
                dtypes.append(t.dtype)
                sizes.append([])
            group = dtypes.index(t.dtype)
            places.append((group, len(sizes[group])))
            sizes[group].append(t.numel())
        shapes = tuple(None if t.dim() == 1 else tuple(t.shape) for t in tensors)
        return _Layout(tuple(dtypes), tuple(places), shapes, tuple(map(tuple, sizes)))

    # Both run for every replayed call: each op they skip (a reshape of a 1-D tensor, a copy
    # into a buffer of one tensor) is host time a step does not spend.
    def pack(
        self, tensors: tuple[torch.Tensor, ...], into: tuple[torch.Tensor, ...] | None = None
    ) -> tuple[torch.Tensor, ...]:
        """The buffers holding `tensors`: new ones, or `into` written."""
        flat: list[list[torch.Tensor]] = [[] for _ in self.dtypes]
        for t, (group, _), shape in zip(tensors, self.places, self.shapes, strict=True):
            flat[group].append(t if shape is None else t.reshape(-1))
        if into is None:
            return tuple(torch.cat(pieces) for pieces in flat)
        for pieces, buffer in zip(flat, into, strict=True):
            if len(pieces) == 1:
                buffer.copy_(pieces[0])
            else:
                torch.cat(pieces, out=buffer)
        return into

    def unpack(self, buffers: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Views of `buffers` as the tensors (no copy)."""
        split = [
            b.split_with_sizes(sizes) if len(sizes) > 1 else (b,)
            for b, sizes in zip(buffers, self.sizes, strict=True)
        ]
        return tuple(
            split[group][i] if shape is None else split[group][i].view(shape)
            for (group, i), shape in zip(self.places, self.shapes, strict=True)
        )


@dataclass
class _Entry:
    graph: CPUGraph | CUDAGraph
    layout_in: _Layout
    inputs: tuple[torch.Tensor, ...]  # the inputs, packed: the graph's, written before replays
    layout_out: _Layout
    outputs: tuple[torch.Tensor, ...]  # the results, packed by the graph: each replay's


class GraphCache:
    """Runs `fn(*inputs)` as a graph captured for its key.

    The first call of a key runs `fn` directly (warm-up: lazily made buffers, first-use
    allocations); the second captures it; later ones replay. The inputs reach the graph in one
    buffer (one concatenation a call) and its results leave in one (one copy): results are
    fresh tensors, views of that copy. At most `limit` keys are kept (the oldest captured is
    dropped first). A capture costs a device synchronization, so when keys keep changing the
    cache stops capturing (it still replays what it holds) after `limit` graphs were dropped:
    callers pad their shapes to a few (`size`).
    Should a CUDA capture fail (an op it cannot record), the cache warns and runs every call
    directly from then on: a capture runs nothing, so no state was touched.

    Args:
        device: CUDA graphs on a CUDA device, the emulation elsewhere.
        enabled: False: every call runs `fn` directly.
        name: for the warning when it stops capturing.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        enabled: bool,
        limit: int = 16,
        name: str = "graphs",
    ):
        self.device = device
        self.enabled = enabled
        self.limit = limit
        self.name = name
        self._entries: dict[Hashable, _Entry] = {}
        self._seen: set[Hashable] = set()
        self._capturing = True
        self._first_shape: tuple[int, ...] | None = None  # (`size`)
        self._shapes_vary = False
        self.captures = 0
        self.replays = 0
        self.dropped = 0

    def size(self, n: int, *shape: int) -> int:
        """The size to run a call of `n` items with (and the rest of its `shape`): `n` while
        graphs are off or every call so far had one shape, then `padded_size(n)` (padding that
        the caller makes inert), so that calls of changing sizes share a few graphs."""
        if not self.enabled:
            return n
        if self._first_shape is None:
            self._first_shape = (n, *shape)
        self._shapes_vary = self._shapes_vary or (n, *shape) != self._first_shape
        return padded_size(n) if self._shapes_vary else n

    def run(
        self,
        key: Hashable,
        fn: Callable[..., tuple[torch.Tensor, ...]],
        *inputs: torch.Tensor,
        capture: bool = True,
    ) -> tuple[torch.Tensor, ...]:
        """`fn(*inputs)`: its graph replayed where `key` was captured, else run op by op, and
        captured (`capture`: a CUDA capture synchronizes) the second time `key` comes."""
        if not self.enabled:
            return fn(*inputs)
        entry = self._entries.get(key)
        if entry is None:
            if key not in self._seen or not self._capturing or not capture:
                if key not in self._seen:
                    self._see(key)
                return fn(*inputs)
            try:
                entry = self._capture(key, fn, inputs)
            except Exception as err:  # noqa: BLE001 - any op the capture refused
                if self._graph_type().executes_at_capture:
                    raise  # the emulation ran part of `fn`: nothing to fall back to
                # A CUDA capture runs nothing: `fn` has not touched any state yet.
                self.enabled = False
                _log.warning(
                    "%s: CUDA graph capture failed, running op by op from now on: %s: %s",
                    self.name, type(err).__name__, err,
                )  # fmt: skip
                return fn(*inputs)
            if not entry.graph.executes_at_capture:
                entry.graph.replay()
        else:
            entry.layout_in.pack(inputs, into=entry.inputs)
            entry.graph.replay()
            self.replays += 1
        return entry.layout_out.unpack(tuple(buffer.clone() for buffer in entry.outputs))

    def _graph_type(self) -> type[CPUGraph] | type[CUDAGraph]:
        return CUDAGraph if self.device.type == "cuda" else CPUGraph

    def _see(self, key: Hashable) -> None:
        if len(self._seen) >= 64 * self.limit:  # shapes that keep changing
            self._seen.clear()
        self._seen.add(key)

    def _stop(self, why: str) -> None:
        if self._capturing:
            self._capturing = False
            _log.warning(
                "%s: %s: CUDA graphs capture no more (%d captured, %d dropped); the calls of "
                "other shapes run op by op",
                self.name, why, self.captures, self.dropped,
            )  # fmt: skip

    def clear(self) -> None:
        """Forget every graph (the tensors they captured were replaced)."""
        self._entries.clear()
        self._seen.clear()

    def _capture(self, key: Hashable, fn, inputs: tuple[torch.Tensor, ...]) -> _Entry:  # noqa: ANN001
        if len(self._entries) >= self.limit:
            self._entries.pop(next(iter(self._entries)))
            self.dropped += 1
            if self.dropped >= self.limit:
                self._stop(f"more than {self.limit} batch shapes in turn")
        graph = self._graph_type()()
        layout_in = _Layout.of(inputs)
        packed_in = layout_in.pack(inputs)
        layouts: list[_Layout] = []

        def packed(*buffers: torch.Tensor) -> tuple[torch.Tensor, ...]:
            outputs = tuple(fn(*layout_in.unpack(buffers)))
            layouts.append(_Layout.of(outputs))
            return layouts[0].pack(outputs)  # (new buffers: the results as they were)

        packed_out = tuple(graph.capture(packed, *packed_in))
        entry = _Entry(graph, layout_in, packed_in, layouts[0], packed_out)
        self._entries[key] = entry
        self.captures += 1
        return entry
