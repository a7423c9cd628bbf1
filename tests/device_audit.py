"""`SyncAudit`: records every op that would make the host wait for a CUDA device, on any device.

On CUDA, an op syncs the host when its result's shape or value must be known on the host:
`.item()`/`int()`/`bool()` (`aten._local_scalar_dense`), boolean-mask indexing, `nonzero`,
`unique` and the other ops PyTorch tags `dynamic_output_shape` or `data_dependent_output`
(`repeat_interleave` only without `output_size`, `index` only with a boolean index), and
`index_fill_` given its value as a tensor (ATen reads it with `.item()` inside the op). The audit
sees the ops as they are dispatched, so it finds them on the CPU too, where CI runs it: the CPU
run of the per-batch path is the same code as the CUDA one.

It does not see what is not dispatched: `.tolist()`/`.numpy()` of host tensors (the stager
reads its pinned host copies so, after the worker waited for them) and stream or event waits.
`tests/gpu` checks those on a GPU with `torch.cuda.set_sync_debug_mode("error")`.

Tensors that live on the host whatever the device (FBGEMM's step counter, `TbeKernel.
host_tensors`) may be named: a read of one of them reads no device.
"""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import distcache

_ROOT = Path(distcache.__file__).resolve().parent
_INDEXING = {"aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"}
# `nonzero_static` (its size given by the host) is not here: since PyTorch 2.6 its CUDA kernel
# keeps the count on the device (pytorch/pytorch#141838); tests/gpu runs it under sync debug.
_ALWAYS = {"aten::nonzero", "aten::masked_select", "aten::equal"}


def reads_back(func, args, kwargs) -> bool:  # noqa: ANN001
    """Whether `func(*args, **kwargs)` would read the device back on CUDA."""
    name = func._schema.name
    if name == "aten::_local_scalar_dense" or name in _ALWAYS or name.startswith("aten::_unique"):
        return True
    if name in _INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
        )
    if name == "aten::repeat_interleave":
        return kwargs.get("output_size", args[-1] if len(args) > 1 else None) is None
    if name in ("aten::index_fill_", "aten::index_fill"):  # a tensor value: ATen takes .item()
        value = args[3] if len(args) > 3 else kwargs.get("value")
        return isinstance(value, torch.Tensor)
    tags = set(func.tags)
    return torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags


def site() -> str:
    """The innermost distcache frame of the current stack (file:line function), else the
    innermost frame outside torch."""
    stack = traceback.extract_stack()[:-3]
    for frame in reversed(stack):
        path = Path(frame.filename).resolve()
        if _ROOT in path.parents:
            return f"{path.relative_to(_ROOT)}:{frame.lineno} {frame.name}"
    for frame in reversed(stack):
        if "torch" not in frame.filename and "device_audit" not in frame.filename:
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
    return "unknown"


class SyncAudit(TorchDispatchMode):
    """Counts read-back ops by call site while active (on this thread; `wrap` extends it to
    functions that run on other threads, such as the stager's worker).

    Example::

        audit = SyncAudit()
        with audit:
            step()
        assert not audit.sites, audit.report()
    """

    def __init__(self, host_tensors: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._host = {t.untyped_storage().data_ptr() for t in host_tensors}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if reads_back(func, args, kwargs) and not self._reads_host(func, args):
            with self._lock:
                self.sites[f"{site()}: {func._schema.name}"] += 1
        return func(*args, **kwargs)

    def _reads_host(self, func, args) -> bool:  # noqa: ANN001
        """`.item()` of a tensor named as living on the host on every device."""
        return (
            func._schema.name == "aten::_local_scalar_dense"
            and args[0].untyped_storage().data_ptr() in self._host
        )

    def wrap(self, fn):  # noqa: ANN001, ANN201
        """`fn`, audited by this audit on whatever thread runs it."""

        def audited(*args, **kwargs):  # noqa: ANN002, ANN003
            with SyncAudit._Nested(self):
                return fn(*args, **kwargs)

        return audited

    def report(self) -> str:
        return "; ".join(f"{n}x {s}" for s, n in self.sites.most_common())

    class _Nested(TorchDispatchMode):
        """A mode on another thread that records into the same audit."""

        def __init__(self, audit: SyncAudit):
            super().__init__()
            self.audit = audit

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            return self.audit.__torch_dispatch__(func, types, args, kwargs)


class OpRecorder(TorchDispatchMode):
    """Records every dispatched op as CUDA graph capture would bake it in: the overload, each
    non-tensor argument's value, and each tensor argument's shape and dtype (not its values,
    which a replay reads from memory).

    Two calls whose records are equal dispatch the same ops with the same host values, so one
    captured graph replays either; a Python number that changes from call to call (a counter,
    an offset) shows up as a difference.

    Example::

        first, second = OpRecorder(), OpRecorder()
        with first:
            work(batch_a)
        with second:
            work(batch_b)
        assert first.ops == second.ops, first.diff(second)
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        values = [*args, *(kwargs[k] for k in sorted(kwargs))]
        baked = tuple(_baked(v) for v in values)
        if func._schema.name.startswith("aten::lift_fresh"):  # torch.tensor(Python data)
            baked += (args[0].tolist(),)
        self.ops.append((str(func), tuple(sorted(kwargs)), baked))
        return func(*args, **kwargs)

    def diff(self, other: OpRecorder, limit: int = 5) -> str:
        """The first `limit` ops that differ, for an assertion message."""
        if len(self.ops) != len(other.ops):
            return f"{len(self.ops)} ops against {len(other.ops)}"
        pairs = [(a, b) for a, b in zip(self.ops, other.ops, strict=True) if a != b]
        return "; ".join(f"{a} != {b}" for a, b in pairs[:limit])


def _baked(value):  # noqa: ANN001, ANN202
    """What a captured graph fixes of an argument."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_baked(v) for v in value)
    return value
