"""distcache's sharder against the unsharded, uncached EmbeddingBagCollection (gloo, CPU)."""

import pytest
import torch

from tests.distributed.fp_case import fp_trained, half_outputs
from tests.distributed.harness import RankFailed, run_ranks
from tests.distributed.sharded_model import train_and_compare, train_with_bad_id


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "kind", ["table_wise", "row_wise", "column_wise", "table_row_wise", "mixed", "planner"]
)
def test_sharded_cached_sgd_equals_unsharded_bitwise(kind):
    results = run_ranks(train_and_compare, 2, args=(kind,), timeout_s=150)
    evicting = [s for stats in results for s in stats.values() if s["evictions"] > 0]
    assert evicting, "caches must be small enough to evict"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("kind", "staging"), [("row_wise", "worker"), ("mixed", "direct")])
def test_cuda_graphs_equal_unsharded_bitwise(kind, staging):
    """The caches' scheduling replayed as (emulated) CUDA graphs, on TorchRec's jagged
    batches: padded to a few sizes, bitwise as the unsharded tables; with direct staging too
    (graphs and direct staging: what CUDA runs by default)."""
    kwargs = {"graphs": True, "steps": 30, "staging": staging}
    results = run_ranks(train_and_compare, 2, args=(kind,), kwargs=kwargs, timeout_s=150)
    stats = [s for rank in results for s in rank.values()]
    assert any(s["evictions"] > 0 for s in stats)
    assert sum(s["graph_replays"] for s in stats) > 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("prefetch", [False, True])
def test_a_scheduler_thread_equals_unsharded_bitwise(prefetch):
    """The caches' scheduling calls on a thread of their own (`CacheConfig.scheduler_thread`),
    with graphs and direct staging (CUDA's defaults), staged at the lookup or ahead by
    TorchRec's prefetch hook: bitwise as the unsharded tables."""
    kwargs = {"graphs": True, "staging": "direct", "scheduler_thread": True, "steps": 30}
    kwargs |= {"prefetch": True, "capacity": 24} if prefetch else {}
    results = run_ranks(train_and_compare, 2, args=("mixed",), kwargs=kwargs, timeout_s=150)
    stats = [s for rank in results for s in rank.values()]
    assert any(s["evictions"] > 0 for s in stats)
    assert sum(s["graph_replays"] for s in stats) > 0
    if prefetch:
        assert all(s["critical_misses"] == 0 for s in stats), stats


@pytest.mark.timeout(180)
def test_rowwise_adagrad_within_tolerance():
    run_ranks(
        train_and_compare,
        2,
        args=("mixed",),
        kwargs={"optimizer": "rowwise_adagrad"},
        timeout_s=150,
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_three_ranks(kind):
    # A table-wise owner receives all three ranks' samples: give the caches room for them.
    run_ranks(train_and_compare, 3, args=(kind,), kwargs={"capacity": 24}, timeout_s=200)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("bad_id", "match"), [(64, "id 64"), (-3, "id -3")])
def test_bad_id_fails_the_job_on_the_rank_that_saw_it(bad_id, match):
    with pytest.raises(RankFailed) as failure:
        run_ranks(train_with_bad_id, 2, args=(bad_id,), timeout_s=90)
    message = str(failure.value)
    assert "rank 1 raised" in message and "InvalidIdError" in message
    assert f"table 't1' (feature 'f1', rank 1): {match}" in message
    assert "[0, 64)" in message


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["row_wise", "mixed"])
def test_prefetch_hook_stages_ahead_without_critical_misses(kind):
    results = run_ranks(
        train_and_compare,
        2,
        args=(kind,),
        kwargs={"prefetch": True, "capacity": 24},
        timeout_s=150,
    )
    stats = [s for per_rank in results for s in per_rank.values()]
    assert all(s["critical_misses"] == 0 for s in stats), stats
    assert sum(s["loads"] for s in stats) > 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["row_wise", "table_wise", "column_wise"])
def test_mean_pooling_within_tolerance(kind):
    # TorchRec pools row-wise shards by sum and divides after the reduce-scatter.
    run_ranks(train_and_compare, 2, args=(kind,), kwargs={"pooling": "mean"}, timeout_s=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise", "table_row_wise"])
def test_weighted_features_equal_unsharded_bitwise(kind):
    """A weighted EBC (`is_weighted=True`, an integer weight per id) through the cached kernel,
    caches small enough to evict: bitwise equal to the unsharded weighted EBC under SGD."""
    results = run_ranks(train_and_compare, 2, args=(kind,), kwargs={"weighted": True})
    assert any(s["evictions"] > 0 for stats in results for s in stats.values())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_position_weighted_features_train_as_on_torchrecs_kernel(kind, pipelined):
    """TorchRec's `FeatureProcessedEmbeddingBagCollection` around distcache's EBC sharder: the
    outputs, the rows and the learned position weights (each id's weight, whose gradient comes
    back through the cached lookup) bitwise those of TorchRec's `fused` kernel in a plain loop;
    trained in a plain loop too, or (`pipelined`) under `LookaheadTrainPipeline`, which drives
    the sharded EBC inside the FP module: each batch routed once, ahead (the FP module's
    forward takes it from the pipeline), and no row missed on the critical path."""
    trained = 0
    kwargs = {"pipelined": pipelined}
    for runs in run_ranks(fp_trained, 2, args=(kind,), kwargs=kwargs, timeout_s=150):
        fused, cached = runs["fused"], runs["customized_kernel"]
        assert cached["loads"] > 0
        assert fused["routings"] == cached["routings"] == len(fused["outputs"]) + 1
        assert cached["critical_misses"] == 0 or not pipelined
        ours, theirs = (k["outputs"] + k["evaluated"] for k in (cached, fused))
        for step, (a, b) in enumerate(zip(theirs, ours, strict=True)):
            for feature in a:
                assert torch.equal(a[feature], b[feature]), (step, feature)
        assert fused["tables"].keys() == cached["tables"].keys()
        for key, shards in fused["tables"].items():
            for a, b in zip(shards, cached["tables"][key], strict=True):
                assert torch.equal(a, b), key
        assert fused["dense"].keys() == cached["dense"].keys() != set()  # the position weights
        for key, weights in fused["dense"].items():
            assert torch.equal(weights, cached["dense"][key]), key
            trained += not torch.equal(weights, torch.ones_like(weights))
    assert trained  # (each rank trains the weights of the features it computes, TorchRec's way)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_hot_rows_under_position_weights_are_refused_in_one_line(kind):
    """Hot ids leave the batch, with their weights, before it is routed; TorchRec's
    `FeatureProcessedEmbeddingBagCollection` weighs the ids after: refused, on every rank,
    naming what to change."""
    with pytest.raises(RankFailed, match=r"UnsupportedError: .* no hot rows"):
        run_ranks(fp_trained, 2, args=(kind, True), timeout_s=100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hot", [False, True])
@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_half_precision_outputs_as_on_torchrecs_kernel(kind, hot):
    """`fused_params={"output_dtype": SparseType.FP16}`: fp16 outputs, on the wire and to the
    model, bitwise those of TorchRec's `fused` kernel, and the same training; with hot rows
    replicated too."""
    for runs in run_ranks(half_outputs, 2, args=(kind, hot), timeout_s=100):
        fused, cached = runs["fused"], runs["customized_kernel"]
        for step, (a, b) in enumerate(zip(fused["outputs"], cached["outputs"], strict=True)):
            for feature in a:
                assert a[feature].dtype == b[feature].dtype == torch.float16, (step, feature)
                assert torch.equal(a[feature], b[feature]), (step, feature)
        for key, shards in fused["tables"].items():
            for a, b in zip(shards, cached["tables"][key], strict=True):
                assert torch.equal(a, b), key
