"""`Lane`: a cache's scheduling calls, run in the order they are queued, on the training
thread or on a thread of their own (`CacheConfig.scheduler_thread`).

On a GPU the host sets a step's pace: the training thread launches the model's kernels, and a
cache's scheduling (a batch entering the window, staging ahead, releases) is host work of its
own on the same thread (benchmarks/results/h200_2026-11-28: 1.4-1.9 ms of a 6.3 ms step). Its
device work is ordered by streams and events, not by the host, so it may run on another
thread, where it overlaps the training thread's launches as far as Python's GIL lets the two
interleave (torch releases it while it dispatches an op, ctypes while a C kernel runs). The
training thread then only queues the calls, and waits for a plan where a batch is looked up,
which the lane made while the batches before it trained.

A queued call runs with the CUDA stream that was current where it was queued (the events it
records and waits for are on the streams they would be on the training thread), and the calls
run one at a time in order, so the scheduler's state changes in the order it would inline: the
plans are the same, bit for bit (tests/unit/cache/test_lane.py). What a caller reads at once
(a batch's seq, whether the window has room, how many batches are staged) comes from the
engine's own counts, not from the scheduler while the lane runs.

An error in a queued call stops the lane: the calls after it do not run (they would run on a
state it left half changed), and every later call of the engine raises it.

Example::

    lane = Lane(None, threaded=True, name="t0")
    done = lane.submit(print, "scheduled")  # a Future (inline: print's result)
    lane.join()  # every queued call has run (raises the first error)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from distcache.errors import DistcacheError


class Lane:
    """Runs one cache's scheduling calls in order.

    Args:
        index: the cache's CUDA device index (None on CPU).
        threaded: run the calls on a thread of their own; False: each call runs when it is
            queued, on the calling thread, and raises there.
        name: the cache, for the thread's name and error messages.
    """

    def __init__(self, index: int | None, *, threaded: bool, name: str):
        self.index = index
        self.threaded = threaded
        self.name = name
        self._error: BaseException | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._last: Future | None = None
        self._pid = os.getpid()  # the process whose thread `_executor` runs

    def submit(self, fn: Callable[..., Any], *args: object) -> Future | Any:
        """Queue `fn(*args)`: a future of its outcome; inline, the outcome itself (raised
        here), with no future to make (the training thread's host time is a GPU step's)."""
        if not self.threaded:
            return fn(*args)
        self._raise_if_failed()
        if self._pid != os.getpid():  # a forked child: the parent's thread is not here
            self._executor, self._last, self._pid = None, None, os.getpid()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                1, thread_name_prefix=f"distcache-schedule-{self.name}"[:40],
                initializer=_on_device, initargs=(self.index,),
            )  # fmt: skip
        stream = None if self.index is None else torch.cuda.current_stream(self.index)
        self._last = self._executor.submit(self._run, stream, fn, args)
        return self._last

    def result(self, future: Future | Any) -> Any:
        """The outcome of a call `submit` queued, waiting for it (a lane's error raised as
        `DistcacheError`)."""
        if not self.threaded:
            return future
        try:
            return future.result()
        except _Stopped:
            self._raise_if_failed()
            raise  # (not reached: a stopped call follows an error)

    def join(self) -> None:
        """Wait until every queued call has run; raise the first error of any."""
        if self._last is not None:
            try:
                self._last.exception()
            finally:
                self._last = None
        self._raise_if_failed()

    def close(self) -> None:
        """Stop the thread once its queued calls have run (a later call starts another)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _run(self, stream: torch.cuda.Stream | None, fn: Callable[..., Any], args: tuple) -> Any:
        if self._error is not None:
            raise _Stopped
        try:
            if stream is not None:
                torch.cuda.set_stream(stream)  # (this thread's current stream)
            return fn(*args)
        except BaseException as err:
            self._error = err
            raise

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err = self._error
            raise DistcacheError(
                f"{self.name}: the cache's scheduler thread failed, and it runs nothing since: "
                f"{type(err).__name__}: {err}"
            ) from err


class _Stopped(Exception):
    """A queued call not run: an earlier one failed."""


def _on_device(index: int | None) -> None:
    """The lane thread's CUDA device (a new thread starts on device 0)."""
    if index is not None:
        torch.cuda.set_device(index)
