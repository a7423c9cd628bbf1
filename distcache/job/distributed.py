"""Process groups of a job, and the one way distcache starts local ranks.

- `process_group`: the group of a training job; under torchrun (or torchx) from its
  environment, else a group of this process alone.
- `single_rank_group`: a one-rank group in this process (a world of one: TorchRec's plans name
  global ranks, so a rank that must plan or train alone needs a default group of its own).
- `run_ranks`: run a function on `world_size` local processes (forks of a server process that
  imported torch once), each with an initialized process group (free port on 127.0.0.1), and
  collect their results in rank order. The parent never hangs: the first rank that raises,
  crashes or overruns the deadline brings the whole group down within about a second, and the
  failure is raised as `RankFailed` naming the rank, with its traceback, so a broken rank
  cannot leave its peers blocked in a collective forever. The distributed tests, `measure`
  and `calibrate` start their ranks with it.

Example::

    def _sum_ranks(rank: int, world_size: int) -> float:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        return t.item()

    assert run_ranks(_sum_ranks, 2) == [1.0, 1.0]
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from distcache.job.host_memory import keep_freed_memory

_POLL_S = 0.05  # queue poll interval of the parent
_COLLECT_S = 0.5  # after a first failure, how long to gather the other ranks' reports
_GRACE_S = 2.0  # terminate -> kill grace, and join time for ranks that finished
T = TypeVar("T")


# ------------------------------------------------------------------------ a job's group


@contextlib.contextmanager
def process_group(device_type: str) -> Iterator[tuple[int, int, torch.device]]:
    """This process's rank, world size and device; under torchrun from its environment, else
    a one-rank group.

    Args:
        device_type: 'cpu' (gloo) or 'cuda' (nccl, the GPU `LOCAL_RANK`).
    """
    # Imported before the group starts, for what it does at import: one of its functions
    # (ZeroRedundancyOptimizer's `_broadcast_object`) takes the default group as the default
    # of an argument, evaluated then. Imported after `init_process_group` (TorchRec's
    # `apply_optimizer_in_backward` imports it on its first call), that default keeps the
    # job's group alive past `destroy_process_group`, and with it gloo's threads into the
    # interpreter's shutdown, where one of them can abort a finished rank ("terminate called
    # without an active exception": once in 72 runs of a 2-rank job on this project's 2-core
    # machine, one core kept busy). (Here, not at the top: about a second of imports that
    # only a job needs, and it needs them anyway.)
    import torch.distributed.optim  # noqa: F401

    if device_type != "cuda":  # a CPU job's big per-step tensors: reused, not faulted in
        keep_freed_memory()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if "RANK" not in os.environ:
        with single_rank_group(backend):
            yield 0, 1, _device(device_type)
        return
    timeout = timedelta(seconds=int(os.environ.get("DISTCACHE_PG_TIMEOUT_S", "300")))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = _attempt_store(rank, world, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    if backend == "gloo":
        # Every rank connected before any goes on. gloo's connect can end on one rank before
        # its peer's: a rank that then fails at once (a checkpoint it would overwrite) and
        # exits left that peer's connect to fail with a traceback instead of its own one-line
        # error (seen once on a loaded machine). (NCCL connects at its first collective.)
        dist.barrier()
    try:
        yield dist.get_rank(), dist.get_world_size(), _device(device_type)
        if backend == "gloo":
            # Every rank done before any tears its group down (not after an error: a dead
            # peer would hold the others here until the group's timeout).
            dist.barrier()
    finally:
        # What the job left (a model's reference cycles hold its groups) goes first, so that
        # destroying the groups ends them, their threads joined, while the interpreter is
        # whole: a group alive into its shutdown can abort the process there (see the
        # import of torch.distributed.optim above).
        gc.collect()
        dist.destroy_process_group()


@contextlib.contextmanager
def single_rank_group(backend: str = "gloo") -> Iterator[None]:
    """A default process group of this process alone (in-memory store, no port)."""
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()  # (as `process_group`: what holds the group goes first)
        if dist.is_initialized():  # the caller may have replaced it, or ended it
            dist.destroy_process_group()


def _device(device_type: str) -> torch.device:
    if device_type != "cuda":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _attempt_store(rank: int, world: int, timeout: timedelta) -> dist.Store:
    """torchrun's store, with keys private to this attempt: after a restart (`--max-restarts`)
    torchrun may hand the new workers the same store, whose keys from the failed attempt
    would make gloo connect to dead peers and hang."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent and rank == 0,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"distcache/attempt_{attempt}", store)


# ------------------------------------------------------------------------ local ranks


class RankFailed(RuntimeError):
    """A rank raised, crashed or timed out; the message names the rank(s), exit codes and the
    remote traceback.

    Attributes:
        ranks: The failing (or, on timeout, unfinished) ranks.
        pids: The pids of all spawned workers; all of them are dead when this is raised.
    """

    def __init__(self, message: str, ranks: list[int], pids: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.pids = pids


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (bind port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True, kw_only=True)
class _Spec:
    """What every rank is told (pickled once, sent to each)."""

    world_size: int
    port: int
    payload: bytes  # pickled (fn, args, kwargs)
    backend: str
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    sys_path: tuple[str, ...] = ()
    parent_env: dict[str, str] = field(default_factory=dict)  # os.environ at `run_ranks`


def _worker(rank: int, spec: _Spec, results: Queue[tuple[str, int, bytes | str]]) -> None:
    """Entry point of one rank: set up the env and process group, run fn, report to the parent.

    `fn` arrives pickled so that `spec.sys_path` can be put on `sys.path` before unpickling
    it; otherwise a test module (`tests.…`) might not be importable in the fresh interpreter.
    """
    for path in reversed(spec.sys_path):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ.clear()  # the parent's environment now, not the fork server's at its start
    os.environ.update(spec.parent_env)
    os.environ.update(spec.env)
    if spec.backend != "nccl":  # CPU ranks (`process_group`)
        keep_freed_memory()
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec.port), RANK=str(rank),
        WORLD_SIZE=str(spec.world_size), LOCAL_RANK=str(rank),
    )  # fmt: skip
    # Several ranks share few cores: one intra-op thread each unless the caller asks otherwise.
    torch.set_num_threads(int(spec.env.get("OMP_NUM_THREADS", "1")))
    try:
        fn, args, kwargs = pickle.loads(spec.payload)
        if spec.backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            spec.backend,
            rank=rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.timeout_s),
        )
        # Pickle here, not in the queue's feeder thread, so an unpicklable result is reported.
        results.put(("ok", rank, pickle.dumps(fn(rank, spec.world_size, *args, **kwargs))))
        # Every rank done before any leaves: a forked rank ends with `os._exit`, which closes
        # its sockets at once, and a peer still reading the last collective's data from it
        # would see the connection reset. (Reported first, so that a rank that never gets here
        # is the one named; the parent ends the ranks that wait for it.)
        if dist.is_initialized() and dist.get_world_size() > 1:
            with contextlib.suppress(Exception):
                dist.barrier()
    except BaseException:  # noqa: B036 - report everything (SystemExit too) to the parent
        results.put(("error", rank, traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., T],
    world_size: int,
    *,
    args: tuple[object, ...] = (),
    kwargs: Mapping[str, object] | None = None,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
    sys_path: Sequence[str] = (),
    alone_in_process: bool = False,
) -> list[T]:
    """Run `fn(rank, world_size, *args, **kwargs)` in `world_size` spawned processes.

    Each process gets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK, an initialized
    default process group (free port on 127.0.0.1, `timeout=timedelta(seconds=timeout_s)`;
    with nccl, the GPU of its rank) and one torch thread unless `env` sets OMP_NUM_THREADS.
    The parent watches the result queue and the exit codes, so a failure surfaces within about
    a second instead of at the deadline. `fn` may replace its rank's default group (destroy it,
    start another); whatever group is up when it returns is destroyed.

    Args:
        fn: Module-level (picklable) function; its return value must be picklable.
        world_size: Number of ranks (processes).
        args: Extra positional arguments for `fn`.
        kwargs: Keyword arguments for `fn`.
        timeout_s: Deadline for the whole run, also the process-group timeout.
        backend: `torch.distributed` backend ('gloo', or 'nccl' with one GPU per rank).
        env: Extra environment variables set in every worker before the process group starts.
        sys_path: Directories put first on each worker's `sys.path` before `fn` is unpickled.
        alone_in_process: A world of one runs in this process, in a one-rank group of its own
            (`single_rank_group`; no deadline, no isolation, `env` only for OMP_NUM_THREADS),
            when no process group is up here: fast, for tools that time one rank.

    Returns:
        The per-rank return values of `fn`, in rank order.

    Raises:
        RankFailed: A rank raised, exited without reporting, or the deadline passed.
    """
    env = dict(env or {})
    if alone_in_process and world_size == 1 and not dist.is_initialized():
        return [_run_here(fn, args, dict(kwargs or {}), backend, env)]
    spec = _Spec(
        world_size=world_size,
        port=free_port(),
        payload=pickle.dumps((fn, args, dict(kwargs or {}))),
        backend=backend,
        timeout_s=timeout_s,
        env=env,
        sys_path=tuple(sys_path),
        parent_env=dict(os.environ),
    )
    return cast("list[T]", _Launch(spec).run())


def _run_here(
    fn: Callable[..., T],
    args: tuple[object, ...],
    kwargs: dict[str, object],
    backend: str,
    env: dict[str, str],
) -> T:
    threads = torch.get_num_threads()
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", threads)))
    try:
        with single_rank_group(backend):
            return fn(0, 1, *args, **kwargs)
    finally:
        torch.set_num_threads(threads)


class _Launch:
    """One `run_ranks` call: start the workers, watch them, stop them all."""

    def __init__(self, spec: _Spec) -> None:
        ctx = _context(spec.backend)
        self.spec = spec
        self.results: Queue[tuple[str, int, bytes | str]] = ctx.Queue()
        # Not daemonic, so that a rank may start its own children (e.g. DataLoader workers).
        self.procs: list[BaseProcess] = [
            ctx.Process(target=_worker, args=(r, spec, self.results), name=f"distcache-rank{r}")
            for r in range(spec.world_size)
        ]
        self.done: dict[int, object] = {}
        self.failures: dict[int, str] = {}
        self.exited: set[int] = set()  # seen dead and unreported; failed if the next poll is empty

    def run(self) -> list[object]:
        started: list[BaseProcess] = []
        try:
            for p in self.procs:
                p.start()
                started.append(p)
            self._watch()
            if self.failures:
                ordered = sorted(self.failures.values(), key=_collateral)
                raise RankFailed("\n\n".join(ordered), sorted(self.failures), self._pids())
            return [self.done[r] for r in range(self.spec.world_size)]
        finally:
            _stop(started, graceful=len(self.done) == self.spec.world_size)
            self.results.cancel_join_thread()
            self.results.close()

    def _pids(self) -> list[int]:
        return [p.pid or 0 for p in self.procs]

    def _watch(self) -> None:
        """Poll until every rank reported, or a failure and `_COLLECT_S` more, or the deadline."""
        world = self.spec.world_size
        deadline = time.monotonic() + self.spec.timeout_s
        collect_until: float | None = None
        while len(self.done) + len(self.failures) < world:
            now = time.monotonic()
            if collect_until is not None and now >= collect_until:
                return
            if collect_until is None and now >= deadline:
                late = [r for r in range(world) if r not in self.done]
                message = (
                    f"timed out after {self.spec.timeout_s} s; rank(s) {late} had not finished"
                )
                raise RankFailed(message, late, self._pids())
            self._poll()
            if self.failures and collect_until is None:
                collect_until = time.monotonic() + _COLLECT_S

    def _poll(self) -> None:
        try:
            status, rank, value = self.results.get(timeout=_POLL_S)
        except queue.Empty:
            self._check_exits()
            return
        if status == "ok":
            self.done[rank] = pickle.loads(value)
        else:
            self.failures.setdefault(rank, f"rank {rank} raised:\n{value}")

    def _check_exits(self) -> None:
        """The queue is drained: a rank seen dead before this empty poll never reported."""
        for r, p in enumerate(self.procs):
            if r in self.done or r in self.failures or p.exitcode is None:
                continue
            if r in self.exited:
                code = _describe_exit(p.exitcode)
                self.failures[r] = f"rank {r} exited with code {code} without reporting"
            self.exited.add(r)


def _describe_exit(code: int | None) -> str:
    """Format an exit code, naming the signal for negative codes (e.g. `-9 (signal SIGKILL)`)."""
    if code is not None and code < 0:
        return f"{code} (signal {signal.Signals(-code).name})"
    return str(code)


def _collateral(report: str) -> bool:
    """Sort key: a peer's gloo "connection closed/reset" error is an effect, list causes first."""
    return "raised:" in report and "by peer" in report


# Modules a rank imports anyway that the fork server imports once (seconds each time a rank
# starts from a fresh interpreter): those this process could import, so none can fail there.
_PRELOAD = ("torch", "torch.distributed", "numpy", "torchrec", "fbgemm_gpu")


def _context(backend: str) -> mp.context.BaseContext:
    """Ranks start as forks of a server process that has imported torch (and TorchRec where
    this process has): 0.3 s for two ranks here instead of 3 s from fresh interpreters (spawn).
    Forked from the server, not from this process: no thread of this one is copied, and no
    CUDA context (the server starts none). Each rank takes this process's environment and
    `sys.path` as a spawned one would (`_worker`, `multiprocessing`'s preparation data).
    GPU ranks (nccl) are spawned: a CUDA build of FBGEMM or TorchRec may start CUDA as it is
    imported, and a fork of a process with CUDA started cannot use it."""
    if backend == "nccl":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([m for m in _PRELOAD if m in sys.modules])
    return ctx


def _stop(procs: list[BaseProcess], *, graceful: bool) -> None:
    """Join `procs`, terminating then killing them; never returns with one still alive.

    Args:
        procs: Started worker processes.
        graceful: All ranks succeeded: give them `_GRACE_S` to tear down before terminating.
    """
    if graceful:
        _join_all(procs)
    for p in procs:
        if p.exitcode is None:
            p.terminate()  # SIGTERM: also ends a rank blocked inside a gloo collective
    _join_all(procs)
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join()


def _join_all(procs: list[BaseProcess]) -> None:
    """Join every process, all of them sharing one `_GRACE_S` budget."""
    end = time.monotonic() + _GRACE_S
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
