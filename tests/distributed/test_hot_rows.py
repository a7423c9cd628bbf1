"""Hot rows replicated on every rank (`CacheConfig.hot_rows`), the rest sharded and cached:
against the unsharded, uncached EmbeddingBagCollection (gloo, CPU)."""

import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.pipeline_sweep_case import three_ways
from tests.distributed.sharded_model import train_and_compare


def _routed_ids(results: list[dict]) -> float:
    return sum(s["ids"] for stats in results for s in stats.values())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise", "mixed"])
def test_hot_rows_sgd_equal_unsharded_bitwise(kind):
    """Bitwise for SGD on integers; the hot ids never reach the caches (fewer routed ids)."""
    hot = run_ranks(train_and_compare, 2, args=(kind,), kwargs={"hot": True}, timeout_s=150)
    assert any(s["evictions"] > 0 for stats in hot for s in stats.values()), hot
    plain = run_ranks(train_and_compare, 2, args=(kind,), timeout_s=150)
    assert _routed_ids(hot) < 0.8 * _routed_ids(plain), (_routed_ids(hot), _routed_ids(plain))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("kind", "kwargs"),
    [
        ("row_wise", {"pooling": "mean"}),  # within tolerance: a mean is not exact
        ("column_wise", {"pooling": "mean"}),
        ("table_wise", {"weighted": True}),  # bitwise: integer weights
        ("mixed", {"optimizer": "rowwise_adagrad"}),  # within tolerance
        ("mixed", {"optimizer": "adam"}),  # lazy Adam: untouched rows and moments unchanged
    ],
)
def test_hot_rows_mean_weighted_and_adagrad(kind, kwargs):
    run_ranks(train_and_compare, 2, args=(kind,), kwargs={"hot": True, **kwargs}, timeout_s=150)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("kind", "kwargs"),
    [
        ("mixed", {"hot_reduce": "touched"}),  # bitwise: SGD on integers
        ("table_wise", {"hot_reduce": "mixed", "weighted": True}),  # one table all-reduced
        ("mixed", {"hot_reduce": "touched", "optimizer": "adam"}),  # untouched rows unchanged
    ],
)
def test_hot_rows_reduce_only_the_touched_rows(kind, kwargs):
    """`CacheConfig.hot_reduce='touched'`: each rank all-gathers only the hot rows its batch
    touched; the training is the same as all-reducing all of them (as unsharded TorchRec)."""
    run_ranks(train_and_compare, 2, args=(kind,), kwargs={"hot": True, **kwargs}, timeout_s=150)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("kind", "kwargs"),
    [
        ("mixed", {}),  # bitwise: SGD on integers; table-, row- and column-wise
        ("row_wise", {"optimizer": "rowwise_adagrad", "pooling": "mean"}),  # within tolerance
        ("mixed", {"hot_reduce": "mixed"}),  # bitwise; two tables all-gather their touched rows
    ],
)
def test_hot_rows_over_torchrecs_fused_kernel(kind, kwargs):
    """Device-stored tables stay on TorchRec's kernel (FBGEMM's); distcache replicates their
    hot rows beside it, reads the replica from its shards and writes it back into them (the
    final comparison reads the tables' state dict)."""
    results = run_ranks(
        train_and_compare,
        2,
        args=(kind,),
        kwargs={"hot": True, "kernel": "fused", **kwargs},
        timeout_s=150,
    )
    assert results == [{}, {}]  # no distcache cache: every table on TorchRec's kernel


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["table_wise", "column_wise"])
def test_hot_rows_send_only_bags_with_cold_ids(kind):
    """Table- and column-wise outputs go through the compact dist: a bag whose ids were all
    hot is not sent (and the training stays bitwise equal to unsharded TorchRec)."""
    results = run_ranks(
        train_and_compare,
        2,
        args=(kind,),
        kwargs={"hot": True, "report_output": True},
        timeout_s=150,
    )
    for result in results:
        assert result["dists"] == 1, result
        assert 0 < result["sent"] < 0.9 * result["full"], result


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kernel", ["cached", "fused"])
def test_hot_rows_follow_a_learning_rate_change(kernel):
    """An LR scheduler changes the rate in the fused optimizer: the replica steps with the
    rate the table's shards use, on every rank (table-wise: one rank holds no shard of t0)."""
    kwargs = {"hot": True, "lr_halved_at": 5}
    if kernel == "fused":
        kwargs["kernel"] = "fused"
    run_ranks(train_and_compare, 2, args=("mixed",), kwargs=kwargs, timeout_s=150)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_hot_rows_on_three_ranks(kind):
    kwargs = {"hot": True, "capacity": 24, "hot_reduce": "touched" if kind == "row_wise" else "all"}
    run_ranks(train_and_compare, 3, args=(kind,), kwargs=kwargs, timeout_s=200)


@pytest.mark.timeout(240)
def test_hot_rows_pipelined_equal_plain_and_uncached():
    """Through LookaheadTrainPipeline: hot ids split off when each batch is routed, L ahead;
    and through TorchRec's prefetch pipeline, one batch ahead; weighted features too (the
    weights that compute receives are those routed with the ids: no refusal)."""
    cases = [
        (kind, 3, 1, 0.0, 12, weighted, True)
        for kind in ("table_wise", "row_wise", "mixed")
        for weighted in (False, True)
    ]
    for results in run_ranks(three_ways, 2, args=(cases,), timeout_s=200):
        for case, result in zip(cases, results, strict=True):
            assert result["pipeline"]["critical"] == 0, (case, result)
            assert result["torchrec_prefetch"]["critical"] == 0, (case, result)


@pytest.mark.timeout(240)
def test_hot_rows_gradients_on_the_default_backend_counts_on_gloo():
    """A default group that is not plain "gloo" ("cpu:gloo" here; NCCL on GPUs) carries the
    replicas' gradients on a group of its backend and the host counts on a gloo group of their
    own: the same training as with one group."""
    kwargs = {"hot": True, "hot_reduce": "mixed", "weighted": True}
    run_ranks(
        train_and_compare, 2, args=("table_wise",), kwargs=kwargs, timeout_s=150, backend="cpu:gloo"
    )
