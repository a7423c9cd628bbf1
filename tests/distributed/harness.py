"""Multi-process test harness for the distributed tests (TorchRec-style, CPU, gloo).

Every distributed test runs its per-rank body through :func:`run_ranks`, which spawns one fresh
process per rank, initializes ``torch.distributed`` in each, and collects the per-rank results.
The parent never hangs: the first rank that raises, crashes or overruns the deadline brings the
whole group down within about a second, and the failure is re-raised as :class:`RankFailed` with
the remote traceback, so a broken rank cannot leave its peers blocked in a collective forever.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_REPO_ROOT = str(Path(__file__).resolve().parents[2])
_POLL_S = 0.05  # queue poll interval of the parent
_COLLECT_S = 0.5  # after a first failure, how long to gather the other ranks' reports
_GRACE_S = 2.0  # terminate -> kill grace, and join time for ranks that finished


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


def _free_port() -> int:
    """Return a currently free TCP port on 127.0.0.1 (bind port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, payload: bytes, backend: str, timeout_s: float,
    env: dict[str, str], root: str, results: Any,
) -> None:  # fmt: skip
    """Entry point of one rank: set up the env and process group, run fn, report to the parent.

    ``fn`` arrives pickled so that the repo root can be put on ``sys.path`` before unpickling it;
    otherwise a test module (``tests.…``) would not be importable in the fresh interpreter.
    """
    if root not in sys.path:
        sys.path.insert(0, root)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
    )  # fmt: skip
    # Several ranks share few cores: one intra-op thread each unless the caller asks otherwise.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    try:
        fn, args, kwargs = pickle.loads(payload)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        # Pickle here, not in the queue's feeder thread, so an unpicklable result is reported.
        results.put(("ok", rank, pickle.dumps(fn(rank, world_size, *args, **kwargs))))
    except BaseException:  # noqa: B036 - report everything (SystemExit too) to the parent
        results.put(("error", rank, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def _describe_exit(code: int | None) -> str:
    """Format an exit code, naming the signal for negative codes (e.g. ``-9 (signal SIGKILL)``)."""
    if code is not None and code < 0:
        return f"{code} (signal {signal.Signals(-code).name})"
    return str(code)


def _collateral(report: str) -> bool:
    """Sort key: a peer's gloo "connection closed/reset" error is an effect, list causes first."""
    return "raised:" in report and "by peer" in report


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` spawned processes.

    Each process gets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK, an initialized process
    group (free port on 127.0.0.1, ``timeout=timedelta(seconds=timeout_s)``) and one torch thread
    unless ``env`` sets OMP_NUM_THREADS. The parent watches the result queue and the exit codes,
    so a failure surfaces within about a second instead of at the deadline.

    Args:
        fn: Module-level (picklable) function; its return value must be picklable.
        world_size: Number of ranks (processes).
        args: Extra positional arguments for ``fn``.
        kwargs: Keyword arguments for ``fn``.
        timeout_s: Deadline for the whole run, also the process-group timeout.
        backend: ``torch.distributed`` backend.
        env: Extra environment variables set in every worker before the process group starts.

    Returns:
        The per-rank return values of ``fn``, in rank order.

    Raises:
        RankFailed: A rank raised, exited without reporting, or the deadline passed.

    Example::

        def _sum_ranks(rank: int, world_size: int) -> float:
            t = torch.tensor([float(rank)])
            dist.all_reduce(t)
            return t.item()

        assert run_ranks(_sum_ranks, 2) == [1.0, 1.0]
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    payload = pickle.dumps((fn, args, kwargs or {}))
    port = _free_port()
    shared = (world_size, port, payload, backend, timeout_s, dict(env or {}), _REPO_ROOT, results)
    # Not daemonic, so that a rank may start its own children (e.g. DataLoader workers).
    procs = [
        ctx.Process(target=_worker, args=(r, *shared), name=f"distcache-rank{r}")
        for r in range(world_size)
    ]
    started: list[Any] = []
    done: dict[int, Any] = {}
    failures: dict[int, str] = {}
    exited: set[int] = set()  # ranks seen dead and unreported; failed if the next poll is empty
    deadline = time.monotonic() + timeout_s
    collect_until: float | None = None
    try:
        for p in procs:
            p.start()
            started.append(p)
        pids = [p.pid for p in procs]
        while len(done) + len(failures) < world_size:
            now = time.monotonic()
            if collect_until is not None and now >= collect_until:
                break
            if collect_until is None and now >= deadline:
                late = [r for r in range(world_size) if r not in done]
                raise RankFailed(
                    f"timed out after {timeout_s} s; rank(s) {late} had not finished", late, pids
                )
            try:
                status, rank, value = results.get(timeout=_POLL_S)
            except queue.Empty:
                status, rank, value = None, -1, None
            if status == "ok":
                done[rank] = pickle.loads(value)
            elif status == "error":
                failures.setdefault(rank, f"rank {rank} raised:\n{value}")
            else:  # queue drained: a rank seen dead before this empty poll never reported
                for r, p in enumerate(procs):
                    if r in done or r in failures or p.exitcode is None:
                        continue
                    if r in exited:
                        code = _describe_exit(p.exitcode)
                        failures[r] = f"rank {r} exited with code {code} without reporting"
                    exited.add(r)
            if failures and collect_until is None:
                collect_until = time.monotonic() + _COLLECT_S
        if failures:
            ordered = sorted(failures.values(), key=_collateral)
            raise RankFailed("\n\n".join(ordered), sorted(failures), pids)
        return [done[r] for r in range(world_size)]
    finally:
        _stop(started, graceful=len(done) == world_size)
        results.cancel_join_thread()
        results.close()


def _stop(procs: list[Any], *, graceful: bool) -> None:
    """Join ``procs``, terminating then killing them; never returns with one still alive.

    Args:
        procs: Started worker processes.
        graceful: All ranks succeeded: give them ``_GRACE_S`` to tear down before terminating.
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


def _join_all(procs: list[Any]) -> None:
    """Join every process, all of them sharing one ``_GRACE_S`` budget."""
    end = time.monotonic() + _GRACE_S
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
