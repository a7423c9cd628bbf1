"""`LookaheadTrainPipeline` on one rank, in this process (a gloo group of one): the pipelined
loop equals the plain loop bitwise, with caches small enough to evict and no critical-path
miss. The multi-rank sweeps are in `tests/distributed/test_pipeline.py`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from distcache.cache.counters import COUNTERS, SUMMED
from distcache.pipeline import LookaheadTrainPipeline
from tests.distributed.pipeline_case import pipelined_vs_plain


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_pipelined_equals_plain_on_one_rank(one_rank: None, kind: str) -> None:
    runs = pipelined_vs_plain(0, 1, kind)
    plain, piped = runs["plain"], runs["pipeline"]
    assert torch.equal(piped["logits"], plain["logits"])
    assert piped["weights"].keys() == plain["weights"].keys()
    for name, shards in plain["weights"].items():
        for a, b in zip(shards, piped["weights"][name], strict=True):
            assert torch.equal(a, b), name
    assert piped["evictions"] > 0, "the caches never evicted: the case tests too little"
    assert piped["critical"] == 0


def test_stats_total_adds_up_every_counter_of_the_caches(one_rank: None) -> None:
    from tests.unit.pipeline.test_recovery import BAD, _batches, _model, _train  # (a cycle)

    pipeline = LookaheadTrainPipeline(_model(), None, "cpu")
    assert _train(pipeline, iter(_batches()[:BAD])) == BAD  # the good ones
    per_cache = pipeline.stats()
    total = per_cache.pop("total")
    own = ["trained_batches", "skipped_nonfinite", "step_s", "wait_fraction"]
    assert list(total) == [*SUMMED, "hit_rate", *own]
    assert len(per_cache) > 1  # the case adds something up
    for name in COUNTERS:
        assert total[name] == sum(s[name] for s in per_cache.values()), name
    assert total["batches"] == BAD * len(per_cache) and total["trained_batches"] == BAD
