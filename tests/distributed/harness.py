"""Multi-process test harness for the distributed tests (TorchRec-style, CPU, gloo).

Every distributed test runs its per-rank body through :func:`run_ranks`, which spawns one fresh
process per rank with an initialized ``torch.distributed`` group and collects the per-rank
results: distcache's own launcher (`distcache.job.distributed.run_ranks`) with the repository
root importable in every rank, so that a test module (``tests.…``) can hold the rank's body.
The parent never hangs: the first rank that raises, crashes or overruns the deadline brings the
whole group down within about a second, and the failure is re-raised as :class:`RankFailed` with
the remote traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from distcache.job.distributed import RankFailed
from distcache.job.distributed import run_ranks as _run_ranks

__all__ = ["RankFailed", "run_ranks"]

_REPO_ROOT = str(Path(__file__).resolve().parents[2])
T = TypeVar("T")


def run_ranks(
    fn: Callable[..., T],
    world_size: int,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
) -> list[T]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` spawned processes.

    Args:
        fn: Module-level (picklable) function; its return value must be picklable.
        world_size: Number of ranks (processes).
        args: Extra positional arguments for ``fn``.
        kwargs: Keyword arguments for ``fn``.
        timeout_s: Deadline for the whole run, also the process-group timeout.
        backend: ``torch.distributed`` backend.
        env: Extra environment variables set in every worker before the process group starts
            (one torch thread per rank unless it sets OMP_NUM_THREADS).

    Returns:
        The per-rank return values of ``fn``, in rank order.

    Raises:
        RankFailed: A rank raised, exited without reporting, or the deadline passed.
    """
    return _run_ranks(
        fn,
        world_size,
        args=args,
        kwargs=kwargs,
        timeout_s=timeout_s,
        backend=backend,
        env=env,
        sys_path=(_REPO_ROOT,),
    )
