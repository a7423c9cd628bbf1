"""Tests of the multi-process harness: results, pass-through, and fast, clean failures."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import RankFailed, run_ranks


def _all_reduce_rank(rank: int, world_size: int) -> tuple[int, float]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, t.item()


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(0.5)  # let rank 0 block in the collective first
        raise ValueError("boom")
    dist.all_reduce(torch.ones(1))


def _exit_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _hang_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(1000)


def _echo(rank: int, world_size: int, scale: int, *, offset: int = 0) -> dict:
    return {
        "value": rank * scale + offset,
        "env": os.environ.get("DISTCACHE_TEST_VAR"),
        "threads": torch.get_num_threads(),
        "dist_env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]),
    }


def _assert_all_dead(pids: list[int]) -> None:
    assert pids and all(pids)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_results_in_rank_order(world_size: int) -> None:
    expected = float(sum(range(world_size)))
    assert run_ranks(_all_reduce_rank, world_size) == [(r, expected) for r in range(world_size)]


@pytest.mark.timeout(60)
def test_args_kwargs_and_env_pass_through() -> None:
    out = run_ranks(_echo, 2, args=(10,), kwargs={"offset": 5}, env={"DISTCACHE_TEST_VAR": "hello"})
    assert [o["value"] for o in out] == [5, 15]
    assert [o["env"] for o in out] == ["hello", "hello"]
    assert [o["threads"] for o in out] == [1, 1]  # one torch thread per rank by default
    assert [o["dist_env"] for o in out] == [("0", "2", "0"), ("1", "2", "1")]
    out = run_ranks(_echo, 2, args=(1,), env={"OMP_NUM_THREADS": "2"})
    assert [o["threads"] for o in out] == [2, 2]


@pytest.mark.timeout(60)
def test_raising_rank_fails_fast_with_remote_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(_raise_on_rank_1, 2, timeout_s=120)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "rank 1" in message and "ValueError" in message and "boom" in message
    assert 1 in info.value.ranks
    _assert_all_dead(info.value.pids)


@pytest.mark.timeout(60)
def test_crashing_rank_reports_exit_code() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(_exit_on_rank_1, 2, timeout_s=120)
    assert time.monotonic() - start < 30
    assert "rank 1 exited with code 3" in str(info.value)
    _assert_all_dead(info.value.pids)


@pytest.mark.timeout(60)
def test_hanging_rank_hits_deadline() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(_hang_on_rank_1, 2, timeout_s=8)
    assert time.monotonic() - start < 30
    assert "timed out" in str(info.value) and "[1]" in str(info.value)
    assert info.value.ranks == [1]
    _assert_all_dead(info.value.pids)
