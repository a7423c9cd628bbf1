"""LookaheadTrainPipeline: same results as the plain loop, no critical-path miss, all batches;
and TorchRec's own `TrainPipelineSparseDist` and `PrefetchTrainPipelineSparseDist` over
distcache's kernel: the same results too (the prefetch pipeline without critical misses)."""

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.distributed.harness import run_ranks
from tests.distributed.pipeline_case import (
    between_steps,
    pipelined_vs_plain,
    semi_sync_refused,
)
from tests.distributed.pipeline_sweep_case import failing_stage, three_ways, two_modules


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_pipeline_equals_plain_loop_without_critical_misses(kind):
    for runs in run_ranks(pipelined_vs_plain, 2, args=(kind,), timeout_s=200):
        plain, piped = runs["plain"], runs["pipeline"]
        theirs, prefetched = runs["torchrec_pipeline"], runs["torchrec_prefetch"]
        for other in (piped, theirs, prefetched):  # every batch trained, to the same bits
            assert other["logits"].shape == plain["logits"].shape
            assert torch.equal(other["logits"], plain["logits"])
            for key, shards in plain["weights"].items():
                for a, b in zip(shards, other["weights"][key], strict=True):
                    assert torch.equal(a, b), key
        assert plain["critical"] > 0 and piped["critical"] == 0
        assert theirs["critical"] == plain["critical"]  # TorchRec's stages no row ahead
        # Its prefetch pipeline stages each batch's rows through the `prefetch` hook, one
        # batch ahead, before the batch is looked up.
        assert prefetched["critical"] == 0 and prefetched["loads"] > 0
        assert piped["loads"] > 0 and piped["evictions"] > 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_evaluations_and_a_load_between_pipeline_steps_equal_the_plain_loops(kind):
    """Between `progress` calls (the window full of batches routed and staged ahead): the
    model evaluated on other batches and on the next training batch itself, bitwise the plain
    loop's evaluations at the same steps; and a state saved earlier loaded (the caches purged,
    the host rows replaced), after which the window's batches train on the loaded rows.
    Training ends bitwise the plain loop's, every batch trained. (Before 2026-11-29 the
    evaluation was refused, or, given a batch of the next one's size, silently computed the
    next batch and broke the window; the load dropped the caches' window under the
    pipeline's.)"""
    for runs in run_ranks(between_steps, 2, args=(kind,), timeout_s=200):
        plain, piped = runs["plain"], runs["pipeline"]
        assert torch.equal(piped["logits"], plain["logits"])
        assert len(piped["evaluated"]) == len(plain["evaluated"]) == 4
        for a, b in zip(plain["evaluated"], piped["evaluated"], strict=True):
            assert torch.equal(a, b)
        for key, shards in plain["weights"].items():
            for a, b in zip(shards, piped["weights"][key], strict=True):
                assert torch.equal(a, b), key
        # Staged anew after the load: the first batch's rows on the critical path.
        assert piped["critical"] < plain["critical"]


@pytest.mark.timeout(120)
def test_torchrecs_semi_sync_pipeline_is_refused_in_one_line():
    """`TrainPipelineSemiSync` looks batch i + 1 up before batch i's backward (stale rows, by
    design): distcache updates rows in the backward, and says so on every rank."""
    for message in run_ranks(semi_sync_refused, 2, timeout_s=100):
        assert "run backward before the next forward" in message, message


@pytest.mark.timeout(240)
def test_pipeline_window_agrees_when_a_rank_holds_no_cache():
    """t0 cached on rank 0 only, the other tables on TorchRec's kernel: both ranks route the
    same batches ahead (the window is bounded by every rank's caches, from the plan, not by
    this rank's), so their collectives match, and training equals the plain loop."""
    results = run_ranks(pipelined_vs_plain, 2, args=("one_cached",), timeout_s=200)
    for runs in results:
        plain = runs["plain"]
        for other in (runs["pipeline"], runs["torchrec_pipeline"], runs["torchrec_prefetch"]):
            assert torch.equal(other["logits"], plain["logits"])
            for key, shards in plain["weights"].items():
                for a, b in zip(shards, other["weights"][key], strict=True):
                    assert torch.equal(a, b), key
    assert results[0]["pipeline"]["loads"] > 0 and results[1]["pipeline"]["loads"] == 0


_KINDS = ["table_wise", "row_wise", "column_wise", "table_row_wise", "mixed"]


@st.composite
def _case(draw):
    lookahead = draw(st.integers(1, 4))
    return (
        draw(st.sampled_from(_KINDS)),
        lookahead,
        draw(st.integers(0, lookahead)),  # K <= L; K = 0 stages each batch as it trains
        draw(st.sampled_from([0.0, 0.0, 0.1, 0.3, 1.0])),  # 0: the in-flight working set
        draw(st.integers(0, 2**16)),
    )


@pytest.mark.timeout(600)
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases=st.lists(_case(), min_size=4, max_size=4))
# Row-wise at 30 %: every shard's cache holds the whole shard (loaded up front, never a miss).
@example(cases=[("row_wise", 2, 2, 0.3, 0), ("table_wise", 2, 1, 0.0, 1),
                ("mixed", 3, 1, 0.1, 3), ("column_wise", 1, 0, 1.0, 2)])  # fmt: skip
def test_pipelined_equals_plain_equals_uncached_torchrec(cases):
    """Hypothesis sweep over sharding type, L, K and cache size down to the in-flight working
    set; batches of varying size and one with no ids; distcache's pipeline and TorchRec's
    prefetch pipeline. Each example runs its cases in one pair of ranks (spawning is the slow
    part)."""
    for results in run_ranks(three_ways, 2, args=(cases,), timeout_s=280):
        for case, result in zip(cases, results, strict=True):
            if case[2] > 0:  # rows staged ahead: the pipelines never wait on a miss
                assert result["pipeline"]["critical"] == 0, (case, result)
                assert result["torchrec_prefetch"]["critical"] == 0, (case, result)
            if not result["plain"]["whole"]:
                assert result["plain"]["critical"] > 0, (case, result)
            else:  # caches of every row: all loaded before the first batch, none after
                assert result["plain"]["loads"] == result["pipeline"]["loads"] == 0, result


@pytest.mark.timeout(180)
def test_weighted_features_pipelined_equal_plain_and_uncached():
    """A weighted EBC: the per-id weights travel with the routed ids through the window."""
    cases = [(kind, 3, 1, 0.0, 12, True) for kind in ("table_wise", "row_wise", "column_wise")]
    evictions = 0
    for results in run_ranks(three_ways, 2, args=(cases,), timeout_s=150):
        for case, result in zip(cases, results, strict=True):
            assert result["pipeline"]["critical"] == 0, (case, result)
            assert result["torchrec_prefetch"]["critical"] == 0, (case, result)
            evictions += result["pipeline"]["evictions"]
    assert evictions > 0  # the caches were small enough to evict (some of the cases)


@pytest.mark.timeout(180)
def test_two_sharded_modules_pipelined_equal_plain():
    for runs in run_ranks(two_modules, 2, timeout_s=150):
        plain, piped = runs["plain"], runs["pipeline"]
        assert len(piped["outputs"]) == len(plain["outputs"]) == 2 * 8
        for a, b in zip(plain["outputs"], piped["outputs"], strict=True):
            assert torch.equal(a, b)
        assert plain["weights"].keys() == piped["weights"].keys()
        for key, shards in plain["weights"].items():
            for a, b in zip(shards, piped["weights"][key], strict=True):
                assert torch.equal(a, b), key


@pytest.mark.timeout(120)
def test_an_exception_in_a_stage_propagates_and_closes_the_pipeline():
    [message] = run_ranks(failing_stage, 1, timeout_s=100)
    assert "10000" in message and "t0" in message
    assert "closed" in message and "InvalidIdError" in message
