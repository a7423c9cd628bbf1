"""distcache's rank launcher and process groups (`distcache.job.distributed`).

The harness's own tests (tests/distributed/test_harness.py) cover results, pass-through and
crashes through the tests' wrapper; these call the launcher directly.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from distcache.job.distributed import (
    RankFailed,
    process_group,
    run_ranks,
    single_rank_group,
)


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise KeyError("rank one broke")
    dist.barrier()  # rank 0 waits for a peer that will never come


def _hang_on_rank_0(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(1000)


def _world(rank: int, world_size: int, scale: int) -> tuple[int, int, int, int]:
    return rank, world_size, dist.get_world_size() * scale, torch.get_num_threads()


def _env(rank: int, world_size: int) -> tuple[str | None, str | None]:
    return os.environ.get("DISTCACHE_TEST_MARK"), os.environ.get("DISTCACHE_TEST_GONE")


def _replace_group(rank: int, world_size: int) -> int:
    dist.destroy_process_group()
    with single_rank_group():
        return dist.get_world_size()


@pytest.mark.timeout(60)
def test_a_raising_rank_fails_fast_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(_raise_on_rank_1, 2, timeout_s=120)
    assert time.monotonic() - start < 30  # not the deadline
    message = str(info.value)
    assert "rank 1 raised" in message and "KeyError: 'rank one broke'" in message
    assert "_raise_on_rank_1" in message  # the remote traceback
    assert 1 in info.value.ranks and message.startswith("rank 1 raised")  # the cause first


@pytest.mark.timeout(60)
def test_a_hanging_rank_fails_at_the_deadline() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"timed out after 6 s; rank\(s\) \[0\]") as info:
        run_ranks(_hang_on_rank_0, 2, timeout_s=6)
    assert 6 <= time.monotonic() - start < 30
    assert info.value.ranks == [0]
    for pid in info.value.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_world_of_one_may_run_in_this_process() -> None:
    threads = torch.get_num_threads()
    out = run_ranks(_world, 1, args=(10,), env={"OMP_NUM_THREADS": "1"}, alone_in_process=True)
    assert out == [(0, 1, 10, 1)]
    assert not dist.is_initialized() and torch.get_num_threads() == threads
    assert run_ranks(_replace_group, 1, alone_in_process=True) == [1]
    assert not dist.is_initialized()


@pytest.mark.timeout(60)
def test_a_rank_may_replace_its_group() -> None:
    assert run_ranks(_replace_group, 2, timeout_s=60) == [1, 1]


def test_outside_torchrun_a_job_is_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with process_group("cpu") as (rank, world, device):
        assert (rank, world, device) == (0, 1, torch.device("cpu"))
        assert dist.get_world_size() == 1
    assert not dist.is_initialized()


@pytest.mark.timeout(60)
def test_ranks_take_this_process_environment_at_each_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ranks are forks of a server started at the first launch: each still sees the
    environment as it is here when it starts (set and unset since), as a spawned one would."""
    monkeypatch.setenv("DISTCACHE_TEST_GONE", "here")
    assert run_ranks(_env, 2, timeout_s=60) == [(None, "here")] * 2
    monkeypatch.setenv("DISTCACHE_TEST_MARK", "1")
    monkeypatch.delenv("DISTCACHE_TEST_GONE")
    assert run_ranks(_env, 2, timeout_s=60) == [("1", None)] * 2
    assert run_ranks(_env, 2, timeout_s=60, env={"DISTCACHE_TEST_MARK": "2"}) == [("2", None)] * 2


@pytest.mark.timeout(90)
def test_gpu_ranks_are_spawned_and_spawned_ranks_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """nccl ranks start from fresh interpreters (a fork of a process whose imports started
    CUDA cannot use it); here the same spawned start, with gloo, runs a world of two."""
    from distcache.job import distributed

    assert distributed._context("nccl").get_start_method() == "spawn"
    assert distributed._context("gloo").get_start_method() == "forkserver"
    spawn = distributed.mp.get_context("spawn")
    monkeypatch.setattr(distributed, "_context", lambda backend: spawn)
    assert run_ranks(_world, 2, args=(3,), timeout_s=60) == [(0, 2, 6, 1), (1, 2, 6, 1)]
