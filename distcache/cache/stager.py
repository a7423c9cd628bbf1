"""`Stager`: executes a `StagePlan` between the host store and the device cache.

Order matters (invariants 3 and 4): the dirty victims are written back before the misses are
loaded, because a loaded row may reuse a victim's slot, and a row written back is only loaded
again (by a later plan) after the write-back completed.

On CPU the copies are plain tensor ops in program order. On CUDA the transfers run on a side
stream: it first waits for the compute stream (the victims' last updates), copies victims to
a pinned buffer and, once there, into the host store; host rows are gathered into a pinned
buffer and copied to the device without blocking the compute stream, which waits on an event
only when it looks the batch up.
"""

from __future__ import annotations

import torch

from distcache.cache.host_store import HostStore
from distcache.cache.scheduler import StagePlan


class Stager:
    """Moves rows for one cache.

    Args:
        store: the host store (authoritative for non-resident rows).
        weights: the cache's weights `[capacity, dim]` on the device.
        state: the cache's optimizer state `[capacity, state_dim]` on the device.
    """

    def __init__(self, store: HostStore, weights: torch.Tensor, state: torch.Tensor):
        self.store = store
        self.weights = weights
        self.state = state
        self.device = weights.device
        self.bytes_loaded = 0
        self.bytes_written = 0
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._ready: dict[int, torch.cuda.Event] = {}

    def run(self, plan: StagePlan) -> None:
        """Write back `plan`'s dirty victims, then load its misses."""
        row_bytes = self.store.row_bytes
        self.bytes_written += plan.writeback_rows.numel() * row_bytes
        self.bytes_loaded += plan.load_rows.numel() * row_bytes
        if self._cuda:
            self._run_cuda(plan)
        else:
            self.write_back(plan.writeback_slots, plan.writeback_rows)
            self._load(plan.load_slots, plan.load_rows)

    def wait(self, plan: StagePlan) -> None:
        """Make the current stream wait until `plan`'s rows are in the cache."""
        event = self._ready.pop(plan.seq, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def write_back(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Copy cache `slots` `[w]` into host `rows` `[w]`, synchronously."""
        if rows.numel() == 0:
            return
        values = torch.cat([self.weights[slots], self.state[slots]], dim=1)
        self.store.scatter(rows.cpu(), values.cpu())

    def _load(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        if rows.numel() == 0:
            return
        values = self.store.gather(rows)
        dim = self.weights.shape[1]
        self.weights.index_copy_(0, slots, values[:, :dim])
        self.state.index_copy_(0, slots, values[:, dim:])

    def _run_cuda(self, plan: StagePlan) -> None:
        assert self._stream is not None
        compute = torch.cuda.current_stream(self.device)
        dim = self.weights.shape[1]
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(compute)
            if plan.writeback_rows.numel():
                values = torch.cat(
                    [self.weights[plan.writeback_slots], self.state[plan.writeback_slots]], 1
                )
                host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                host.copy_(values, non_blocking=True)
                rows = plan.writeback_rows.to("cpu", non_blocking=True)
                self._stream.synchronize()  # host scatter needs the bytes; compute runs on
                self.store.scatter(rows, host)
            if plan.load_rows.numel():
                rows = plan.load_rows.cpu()
                staged = torch.empty((rows.numel(), self.store.width), pin_memory=True)
                self.store.gather(rows, out=staged)
                values = staged.to(self.device, non_blocking=True)
                # The caching host allocator keeps `staged` until this stream's copy has run.
                self.weights.index_copy_(0, plan.load_slots, values[:, :dim])
                self.state.index_copy_(0, plan.load_slots, values[:, dim:])
            event = torch.cuda.Event()
            event.record(self._stream)
        self._ready[plan.seq] = event
