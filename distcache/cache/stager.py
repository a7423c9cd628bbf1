"""`Stager`: executes `StagePlan`s between the host store and the device cache, off the training
thread.

Order matters (invariants 3 and 4): the dirty victims are written back before the misses are
loaded, because a loaded row may reuse a victim's slot, and a row written back is only loaded
again (by a later plan) after the write-back completed: plans run one at a time, in order, on one
worker thread.

`submit(plan)` (training thread, schedule stream) queues copies of the plan's counts and host row
lists into host buffers and records an event; it never waits. The worker thread then waits for
that event (its job is to wait), reads how many rows move, and:
1. write-back: on the staging stream, after the event that followed the last backward before the
   plan was made (the victims' last update), gathers the dirty victims, copies them to the host
   and scatters them into the host store;
2. load: gathers the missed rows from the host store into a host buffer, copies them to the
   device and into their slots on the staging stream, and records the plan's *ready* event.
`wait(plan)` (training thread, at the batch's lookup) waits for the worker to have queued that,
which it usually did K batches ago, and makes the compute stream wait for the ready event on the
device. On CPU the same code runs (no streams or events) on the thread that submits the plan,
unless `threaded=True`: with no device to wait for, and the training thread's OpenMP team on
every core, a second thread only competes for them (`Stager`'s docstring has the figures); the
tests run both.

With `direct=True` (`CacheConfig.staging="direct"`) there is no worker: `submit` queues both
steps on the staging stream itself, as row copies between the cache and the host store's rows
addressed from the device (`transfer.copy_rows`, bounded by the plan's counts on the device), so
nothing waits for the counts; they reach the host by an asynchronous copy that `wait` reads at
the batch's lookup, K batches after it was queued. On CPU those copies run in `submit`, on the
calling thread.

A cache of every row moves nothing after `load_all` (`StagePlan.moves` False): its plans get
no worker job and no copies, only their counts mirrored and an event after the plan and the
load.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from distcache.cache import fused
from distcache.cache.host_store import HostStore
from distcache.cache.plan import LOADS, WRITEBACKS, StagePlan
from distcache.cache.streams import Streams, mirror
from distcache.cache.transfer import copy_rows


@dataclass(eq=False)
class _Job:
    plan: StagePlan
    counts: torch.Tensor  # [NUM_COUNTS] host copy of plan.counts
    load_rows: torch.Tensor | None  # [size] host copy of plan.load_rows (worker only)
    writeback_rows: torch.Tensor | None  # [size] host copy of plan.writeback_rows (worker only)
    check: torch.Tensor | None  # host copy of the caller's check words, if any
    mirrored: torch.cuda.Event | None  # the host copies above are complete
    victims_free: torch.cuda.Event | None  # the last backward before the plan was made
    ready: torch.cuda.Event | None = None  # the plan's rows are in the cache


class Stager:
    """Moves rows for one cache.

    Args:
        store: the host store (authoritative for non-resident rows).
        weights: the cache's weights `[capacity + 2, dim]` on the device (the last two rows
            are the sentinel slot's and the trash slot's).
        state: the cache's optimizer state `[capacity + 2, state_dim]` on the device.
        streams: the cache's streams.
        direct: stage on the staging stream alone, addressing the host rows from the device
            (no worker thread).
        threaded: execute plans on the worker thread (default: on CUDA, where it waits for the
            device; on CPU a plan runs when it is submitted: there a worker thread has no
            device to wait for, and its copies would only compete with the training thread
            for the cores of its OpenMP team: benchmarks/results/README.md, "The engine").
        move: the C kernels' row copy (`fused.move`), used on CPU; None: torch's gathers and
            scatters through host buffers.
    """

    def __init__(
        self,
        store: HostStore,
        weights: torch.Tensor,
        state: torch.Tensor,
        streams: Streams,
        *,
        direct: bool = False,
        threaded: bool | None = None,
        move: object | None = None,
    ):
        self.store = store
        self.direct = direct
        self.threaded = streams.cuda if threaded is None else threaded
        self.trash_slot = weights.shape[0] - 1
        self.weights = weights
        self.state = state
        self.streams = streams
        self.device = weights.device
        self.victims_free: torch.cuda.Event | None = None  # set by the engine after a backward
        # The C kernels' row copies (`fused.move`), where the cache is in host memory (CPU).
        self.move = move if self.device.type == "cpu" else None
        self._jobs: dict[int, tuple[_Job, Future[None]]] = {}
        self._executor: ThreadPoolExecutor | None = None
        # The worker's host rows (`_host_rows`), and the event after the copy that last read
        # them (CUDA).
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rows_read: torch.cuda.Event | None = None
        self._loaded_all: torch.cuda.Event | None = None  # after `load_all`'s copies (CUDA)

    def submit(self, plan: StagePlan, check: torch.Tensor | None = None) -> None:
        """Queue `plan`'s transfers (call on the stream that made the plan); returns at once.

        `check`: device int64 words to bring to the host with the plan's counts.
        """
        s = self.streams
        if not plan.moves:  # a cache of every row: its event follows `load_all` too
            s.wait(self._loaded_all)
        rows = plan.moves and not self.direct  # the worker needs the row lists on the host
        job = _Job(
            plan=plan,
            counts=mirror(plan.counts),
            load_rows=mirror(plan.load_rows) if rows else None,
            writeback_rows=mirror(plan.writeback_rows) if rows else None,
            check=None if check is None else mirror(check),
            mirrored=s.record(host=True),
            victims_free=self.victims_free,
        )
        if not plan.moves:  # no transfer, no worker: ready once the plan and the rows are
            job.ready = job.mirrored
            self._jobs[plan.seq] = (job, None)
            return
        if self.direct:
            self._stage_direct(job)
            self._jobs[plan.seq] = (job, None)
            return
        if not self.threaded:
            self._jobs[plan.seq] = (job, _run_now(self._execute, job))
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="distcache-stager")
        self._jobs[plan.seq] = (job, self._executor.submit(self._execute, job))

    def wait(self, plan: StagePlan) -> tuple[list[int], list[int] | None]:
        """Wait until `plan`'s transfers are queued (host) and make the current stream wait for
        them (device). Returns the plan's counts (`plan.UNIQUE`, ...) and check words, now
        on the host (the worker waited for their copies)."""
        job, future = self._jobs.pop(plan.seq)
        if future is not None:
            future.result()  # re-raises what the worker raised
        else:  # direct: the counts' copy, queued when the plan was made (K batches ago)
            self.streams.host_wait(job.mirrored)
        self.streams.wait(job.ready)
        check = None if job.check is None else job.check.numpy().tolist()
        counts = job.counts.numpy().tolist()
        if future is None:
            self.store.rows_read += counts[LOADS]
            self.store.rows_written += counts[WRITEBACKS]
        return counts, check

    def load_all(self, count: int) -> None:
        """Copy host rows [0, count) into slots [0, count) (a cache of every row, once after it
        was emptied): on the staging stream, after the slots' last update and before any later
        plan's copies and ready event; `drain` waits for it before the host rows change."""
        s = self.streams
        with s.on(s.staging):
            s.wait(self.victims_free, s.staging)
            for cache, host in zip(
                (self.weights, self.state), (self.store.weights, self.store.state), strict=True
            ):
                cache[:count].copy_(host[:count], non_blocking=True)
            self._loaded_all = s.record(s.staging, host=True)
        self.store.rows_read += count

    def drain(self) -> None:
        """Wait for every submitted plan (host); their rows are in place once the device gets
        there (the current stream waits for them)."""
        self.streams.host_wait(self._loaded_all)  # the host rows may change after this
        for job, future in list(self._jobs.values()):
            if future is not None:
                future.result()
            self.streams.wait(job.ready)

    def forget(self) -> None:
        """`drain`, then drop every submitted plan (the window they were staged for is gone):
        their transfers are done, and their rows counted as `wait` counts them."""
        self.drain()
        for job, future in self._jobs.values():
            if future is None:  # direct staging: the worker did not count its rows
                self.streams.host_wait(job.mirrored)
                counts = job.counts.numpy().tolist()
                self.store.rows_read += counts[LOADS]
                self.store.rows_written += counts[WRITEBACKS]
        self._jobs.clear()

    def write_back(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Copy cache `slots` `[w]` into host `rows` `[w]`, synchronously (flush)."""
        if rows.numel() == 0:
            return
        weights, state = self._cached_rows(slots)
        self.store.scatter(rows.cpu(), weights.cpu(), state.cpu())

    def _cached_rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's weights `[w, dim]` and optimizer state `[w, state_dim]` at `slots`."""
        return self.weights.index_select(0, slots), self.state.index_select(0, slots)

    def _host_rows(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host buffers for `count` rows: weights (the rows' dtype) and state (float32).

        Views of two buffers reused by one plan at a time (grown when a plan moves more rows):
        fresh host memory would be page-faulted in on every batch (about 550 faults a batch
        at 5 k rows of 256 bytes each way, most of the worker's time on this project's CPU
        machine). Before their rows are overwritten, the worker waits for the copy that last
        read them (the previous load's, to the device)."""
        s = self.streams
        held = 0 if self._rows is None else self._rows[0].shape[0]
        if count > held:
            rows = max(count, 2 * held)
            self._rows = (
                s.host_buffer((rows, self.weights.shape[1]), self.weights.dtype),
                s.host_buffer((rows, self.state.shape[1]), self.state.dtype),
            )
        else:
            s.host_wait(self._rows_read)
        return self._rows[0][:count], self._rows[1][:count]

    # ------------------------------------------------------------ worker (a thread on CUDA)
    def _execute(self, job: _Job) -> None:
        s = self.streams
        s.host_wait(job.mirrored)  # the worker, not the training thread, waits for the plan
        counts = job.counts.numpy()  # a host buffer: no device read
        loads, writebacks = int(counts[LOADS]), int(counts[WRITEBACKS])
        with s.on(s.staging):
            s.wait(job.mirrored, s.staging)
            s.wait(job.victims_free, s.staging)
            # The C kernels copy row to row (CPU); else through host buffers.
            (self._copy if self.move is None else self._move)(job, writebacks, loads)
            job.ready = s.record(s.staging)

    def _copy(self, job: _Job, writebacks: int, loads: int) -> None:
        """`_execute`'s copies through the host buffers (on the staging stream): the dirty
        victims' rows to the store, then the loaded rows into their slots."""
        s, plan = self.streams, job.plan
        if writebacks:
            host = self._host_rows(writebacks)
            for buffer, values in zip(
                host, self._cached_rows(plan.writeback_slots[:writebacks]), strict=True
            ):
                buffer.copy_(values, non_blocking=True)
            s.host_wait(s.record(s.staging, host=True))
            self.store.scatter(job.writeback_rows[:writebacks], *host)
        if loads:
            host = self.store.gather(job.load_rows[:loads], out=self._host_rows(loads))
            slots = plan.load_slots[:loads]
            for cache, buffer in zip((self.weights, self.state), host, strict=True):
                cache.index_copy_(0, slots, buffer.to(self.device, non_blocking=True))
            self._rows_read = s.record(s.staging, host=True)

    def _move(self, job: _Job, writebacks: int, loads: int) -> None:
        """`_execute`'s copies by the C kernels (on CPU, where the cache is host memory): the
        dirty victims' rows to the store, then the loaded rows into their slots."""
        plan, store, cache = job.plan, self.store, (self.weights, self.state)
        slots, rows = plan.writeback_slots[:writebacks], job.writeback_rows[:writebacks]
        for src, dst in zip(cache, (store.weights, store.state), strict=True):
            fused.move(self.move, src, slots, dst, rows)
        store.rows_written += writebacks
        rows, slots = job.load_rows[:loads], plan.load_slots[:loads]
        for src, dst in zip((store.weights, store.state), cache, strict=True):
            fused.move(self.move, src, rows, dst, slots)
        store.rows_read += loads

    # ------------------------------------------------------------ direct
    def _stage_direct(self, job: _Job) -> None:
        """Queue `job`'s write-back, then its loads, on the staging stream: row copies between
        the cache and the host rows as the device addresses them, bounded by the plan's counts
        on the device (the padding goes from and to the trash row and slot)."""
        s, plan = self.streams, job.plan
        host = self.store.device_rows(self.device)
        cache = (self.weights, self.state)
        trash_row, trash_slot = self.store.trash_row, self.trash_slot
        with s.on(s.staging):
            s.wait(job.mirrored, s.staging)  # the plan is made
            s.wait(job.victims_free, s.staging)  # the victims' last update is done
            for tensor in (plan.counts, plan.load_rows, plan.load_slots, plan.writeback_rows,
                           plan.writeback_slots):  # fmt: skip
                s.keep_for(tensor, s.staging)  # (made on the schedule stream)
            writebacks = plan.counts[WRITEBACKS : WRITEBACKS + 1]
            for src, dst in zip(cache, host, strict=True):
                copy_rows(src, plan.writeback_slots, dst, plan.writeback_rows, writebacks,
                          src_trash=trash_slot, dst_trash=trash_row)  # fmt: skip
            loads = plan.counts[LOADS : LOADS + 1]
            for src, dst in zip(host, cache, strict=True):
                copy_rows(src, plan.load_rows, dst, plan.load_slots, loads,
                          src_trash=trash_row, dst_trash=trash_slot)  # fmt: skip
            job.ready = s.record(s.staging)


def _run_now(fn, *args) -> Future[None]:  # noqa: ANN001, ANN002
    """`fn(*args)` run on this thread, its outcome in a future (as the worker's would be: an
    error is raised where the plan is waited for)."""
    future: Future[None] = Future()
    try:
        future.set_result(fn(*args))
    except Exception as err:  # re-raised by `wait`, as from the worker
        future.set_exception(err)
    return future
