"""`LookaheadTrainPipeline` on one rank, in this process (a gloo group of one): the pipelined
loop equals the plain loop bitwise, with caches small enough to evict and no critical-path
miss. The multi-rank sweeps are in `tests/distributed/test_pipeline.py`."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from distcache.cache.counters import COUNTERS, SUMMED
from distcache.errors import LookaheadWindowError
from distcache.pipeline import LookaheadTrainPipeline
from distcache.sharding.sharded_module import CachedShardedModule
from tests.distributed.pipeline_case import pipelined_vs_plain
from tests.distributed.pipeline_sweep_case import EbcTrain


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


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_fused_scheduler_trains_through_dmp_as_the_torch_ops(one_rank: None) -> None:
    """`CacheConfig.fused` through TorchRec's sharder, DMP and the pipeline (the kernels under
    Triton's interpreter): the logits and the weights of both loops, bitwise."""
    torch_ops, kernels = (pipelined_vs_plain(0, 1, "table_wise", fused=f) for f in (False, True))
    for loop in ("plain", "pipeline"):
        assert torch.equal(kernels[loop]["logits"], torch_ops[loop]["logits"]), loop
        for name, shards in torch_ops[loop]["weights"].items():
            for a, b in zip(shards, kernels[loop]["weights"][name], strict=True):
                assert torch.equal(a, b), (loop, name)
    for loop in ("plain", "pipeline"):  # the same rows loaded and evicted: the same plans
        for counter in ("loads", "evictions"):
            assert kernels[loop][counter] == torch_ops[loop][counter], (loop, counter)
    assert kernels["pipeline"]["evictions"] > 0


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


def test_a_module_computes_its_routed_input_in_progress_and_routes_its_own_outside(
    one_rank: None,
) -> None:
    """Nothing is swapped in: `forward` is the module's own, reading the batch that
    `CachedShardedModule.routed` hands it while the batch trains; an evaluation outside
    `progress` routes its features as usual."""
    from tests.unit.pipeline.test_recovery import BAD, _batches, _model, _train  # (a cycle)

    model = _model()
    (module,) = [m for m in model.modules() if isinstance(m, CachedShardedModule)]
    calls: list[tuple[bool, bool]] = []
    module.register_forward_pre_hook(
        lambda m, args: calls.append(("forward" in vars(m), m._routed_input is not None))
    )
    pipeline = LookaheadTrainPipeline(model, None, "cpu")
    batches = _batches()
    assert _train(pipeline, iter(batches[:BAD])) == BAD
    assert calls == [(False, True)] * BAD and module._routed_input is None
    with torch.no_grad():
        model(batches[0])
    assert calls[-1] == (False, False)


class _OtherFeatures(EbcTrain):
    """Calls its collection with features other than the batch's own (one id fewer)."""

    def forward(self, batch):  # noqa: ANN001, ANN201
        kjt = batch.sparse_features
        lengths = kjt.lengths().clone()
        lengths[lengths.nonzero()[0]] -= 1
        other = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values()[1:], lengths)
        return super().forward(replace(batch, sparse_features=other))


def test_a_module_called_with_other_features_than_routed_is_named(one_rank: None) -> None:
    from tests.unit.pipeline.test_recovery import _batches, _model  # (a cycle)

    model = _model()
    model._dmp_wrapped_module.__class__ = _OtherFeatures  # same module, other features
    pipeline = LookaheadTrainPipeline(model, None, "cpu")
    with pytest.raises(LookaheadWindowError, match="'ebc' was called with features other"):
        pipeline.progress(iter(_batches()))
