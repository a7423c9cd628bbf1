"""distcache's EmbeddingCollection sharder against the unsharded, uncached EmbeddingCollection
(gloo, CPU): per-id rows of sequence features through the same look-ahead caches."""

import pytest
import torch

from distcache.sharding import CACHED_KERNEL
from tests.distributed.ec_case import (
    bags_and_sequences_pipelined_vs_plain,
    ec_hot_rows_on_torchrecs_kernel,
    ec_with_bad_id,
    loaded_between_steps,
    planner_plans_bags_and_sequences,
    sequence_bytes_match_the_model,
    train_ec_and_compare,
)
from tests.distributed.harness import RankFailed, run_ranks


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise", "mixed"])
def test_sharded_cached_ec_sgd_equals_unsharded_bitwise(kind):
    results = run_ranks(train_ec_and_compare, 2, args=(kind,), timeout_s=150)
    assert any(s["evictions"] > 0 for stats in results for s in stats.values()), results


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("kind", "optimizer"), [("row_wise", "sgd"), ("mixed", "adam")])
def test_ec_hot_rows_reducing_touched_rows_equal_unsharded(kind, optimizer):
    """The same with s2's replica reduced as the rows each rank touched (s0's all its rows)."""
    kwargs = {"optimizer": optimizer, "hot": "touched"}
    run_ranks(train_ec_and_compare, 2, args=(kind,), kwargs=kwargs, timeout_s=150)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("kind", "optimizer"),
    [("table_wise", "sgd"), ("row_wise", "sgd"), ("column_wise", "sgd"), ("mixed", "adam")],
)
def test_ec_hot_rows_equal_unsharded(kind, optimizer):
    """Hot rows of sequence features: each hot id's row from the replica, put back in its
    place among the sharded ids' rows; bitwise for SGD on integers, lazy Adam within float
    tolerance; the hot ids never reach the caches (fewer routed ids)."""
    kwargs = {"optimizer": optimizer}
    hot = run_ranks(train_ec_and_compare, 2, args=(kind,), kwargs=kwargs | {"hot": True},
                    timeout_s=150)  # fmt: skip
    plain = run_ranks(train_ec_and_compare, 2, args=(kind,), kwargs=kwargs, timeout_s=150)
    routed = [sum(s["ids"] for stats in r for s in stats.values()) for r in (hot, plain)]
    assert routed[0] < 0.8 * routed[1], routed


@pytest.mark.timeout(120)
def test_ec_hot_rows_on_torchrecs_own_kernel_are_refused():
    with pytest.raises(RankFailed) as failure:
        run_ranks(ec_hot_rows_on_torchrecs_kernel, 1, timeout_s=90)
    message = str(failure.value)
    assert (
        "UnsupportedError: hot_rows of EmbeddingCollection tables need distcache's kernel"
        in (message)
        and "tables ['s0'] are on TorchRec's" in message
    ), message[-2000:]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("hot", [False, True])
def test_ebc_and_ec_in_one_model_pipelined_equal_plain_without_critical_misses(hot):
    """distcache's pipeline and TorchRec's two, against the plain loop; distcache's evaluated
    between its steps as the plain loop is at the same steps."""
    runs_per_rank = run_ranks(
        bags_and_sequences_pipelined_vs_plain, 2, kwargs={"hot": hot}, timeout_s=150
    )
    for runs in runs_per_rank:
        plain = runs["plain"]
        assert runs["pipeline_critical"] == 0 and runs["evictions"] > 0, runs
        # TorchRec's pipelines: its plain one stages nothing ahead, its prefetch one stages
        # each batch through the `prefetch` hook before its lookup.
        assert runs["torchrec_pipeline_critical"] == runs["plain_critical"] > 0, runs
        assert runs["torchrec_prefetch_critical"] == 0, runs
        assert any(k.startswith("seq.") for k in plain["weights"]), plain["weights"].keys()
        evaluated, expected = runs["pipeline"]["evaluated"], runs["plain_evaluated"]["evaluated"]
        assert len(evaluated) == len(expected) > 0
        for a, b in zip(expected, evaluated, strict=True):
            assert torch.equal(a, b)
        for name in ("plain_evaluated", "pipeline", "torchrec_pipeline", "torchrec_prefetch"):
            other = runs[name]
            assert len(other["outputs"]) == len(plain["outputs"]) > 0, name
            for a, b in zip(plain["outputs"], other["outputs"], strict=True):
                assert torch.equal(a, b), name
            assert plain["weights"].keys() == other["weights"].keys()
            for key, shards in plain["weights"].items():
                for a, b in zip(shards, other["weights"][key], strict=True):
                    assert torch.equal(a, b), (name, key)


@pytest.mark.timeout(180)
def test_a_load_between_pipeline_steps_with_hot_rows_equals_the_plain_loops():
    """An EBC and an EC with hot rows: a state loaded between `LookaheadTrainPipeline`'s steps
    (the caches and the replicas purged, the window's batches staged anew) trains on as the
    plain loop that loads the same state at the same step, bitwise."""
    for runs in run_ranks(loaded_between_steps, 2, timeout_s=150):
        plain, piped = runs["plain"], runs["pipeline"]
        assert len(piped["outputs"]) == len(plain["outputs"]) > 0
        for a, b in zip(plain["outputs"], piped["outputs"], strict=True):
            assert torch.equal(a, b)
        for key, shards in plain["weights"].items():
            for a, b in zip(shards, piped["weights"][key], strict=True):
                assert torch.equal(a, b), key


@pytest.mark.timeout(180)
def test_planner_gives_ebc_and_ec_tables_the_cached_kernel_and_their_configs():
    results = run_ranks(planner_plans_bags_and_sequences, 2, timeout_s=150)
    for result in results:
        assert result["configs"].keys() == result["expected"].keys()
        for table, (_, kernel, config) in result["configs"].items():
            assert kernel == CACHED_KERNEL, (table, kernel)
            assert config == result["expected"][table], table
        assert result["batches"] > 0
    # Some caches cannot hold the 2 batches x 3 samples x 2 ranks in flight: raised alike.
    assert results[0]["raised"] and results[0]["raised"] == results[1]["raised"]
    assert results[0]["configs"] == results[1]["configs"]  # one plan over both ranks


@pytest.mark.timeout(120)
def test_a_bad_id_fails_the_job_on_the_rank_that_saw_it():
    with pytest.raises(RankFailed) as failure:
        run_ranks(ec_with_bad_id, 2, args=(64,), timeout_s=90)
    message = str(failure.value)
    assert "rank 1 raised" in message and "InvalidIdError" in message
    assert "table 's1' (feature 'q1', rank 1): id 64" in message and "[0, 64)" in message


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "column_wise"])
def test_sequence_tables_all_to_all_bytes_match_the_model(sharding):
    """The cost model's all-to-all bytes of sequence tables (one output row per id, not per
    bag) against what TorchRec's own EmbeddingCollection sharding sends on 2 ranks: equal, but
    for TorchRec's lengths and split sizes (at most 8 bytes a bag and 64 a step)."""
    results = run_ranks(sequence_bytes_match_the_model, 2, args=(sharding,), timeout_s=150)
    for r in results:
        assert r["modelled"] <= r["measured"] <= r["modelled"] + 8 * r["bags"] + 64, results
    assert sum(r["modelled"] for r in results) > 0, results
