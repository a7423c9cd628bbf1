"""`keep_freed_memory`: a big tensor made again each step reuses freed memory (glibc) instead
of having every page faulted in again; the ranks that `run_ranks` starts call it."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from distcache.job.distributed import run_ranks

MIB = 1 << 20


def _faults_of_a_second_big_tensor(rank: int, world_size: int) -> int:
    """Minor page faults while a 64 MiB tensor is made and written, after one like it was."""
    torch.ones(16 * MIB)  # made, written and freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 * MIB)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.timeout(60)
def test_a_rank_reuses_a_freed_big_tensor_instead_of_faulting_it_in_again() -> None:
    pages = 64 * MIB // 4096
    (kept,) = run_ranks(_faults_of_a_second_big_tensor, 1, timeout_s=60)
    (default,) = run_ranks(
        _faults_of_a_second_big_tensor,
        1,
        timeout_s=60,
        env={"DISTCACHE_KEEP_FREED_MEMORY": "0"},
    )
    assert kept < pages // 10 < default, (kept, default, pages)
