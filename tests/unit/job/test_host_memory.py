"""`keep_freed_memory`: big tensors made again every step reuse freed memory (glibc) instead of
having every page faulted in again; the CPU ranks that `run_ranks` starts call it."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from distcache.job.distributed import run_ranks

MIB = 1 << 20
STEPS, COUNTED = 16, 8


def _faults_per_step(rank: int, world_size: int) -> list[int]:
    """Minor page faults of each of `STEPS` steps that make two 64 MiB tensors and free them."""
    faults = []
    for _ in range(STEPS):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.ones(16 * MIB)
        y = x * 2
        del x, y
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.timeout(60)
def test_a_rank_reuses_freed_big_tensors_instead_of_faulting_them_in_every_step() -> None:
    pages = 2 * 64 * MIB // 4096  # a step's two tensors
    (kept,) = run_ranks(_faults_per_step, 1, timeout_s=60)
    (default,) = run_ranks(
        _faults_per_step, 1, timeout_s=60, env={"DISTCACHE_KEEP_FREED_MEMORY": "0"}
    )
    # glibc's defaults fault both tensors in every step (4 KiB pages: `pages` a step; fewer
    # with transparent huge pages always on); kept, the heap settles within a few steps (freed
    # blocks merge until they fit the next step's), then faults nearly none.
    refaulted = sum(default[-COUNTED:])
    if refaulted < COUNTED:
        pytest.skip(f"this machine's allocator refaults nothing by default: {default}")
    assert sum(kept[-COUNTED:]) < 0.25 * refaulted, (kept, default, pages)
