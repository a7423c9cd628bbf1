"""distcache under TorchRec on CUDA: a single-rank DMP model with distcache's sharder trains like
the same model without a cache, and `LookaheadTrainPipeline` like the plain loop (bitwise).

The GPU machine has FBGEMM's CPU ops only, so TorchRec's own fused CUDA kernel cannot be the
reference: the uncached twin is plain `nn.EmbeddingBag`s (as in `tests/unit/cache/reference.py`),
and TorchRec's sparse bookkeeping stays on the host (`dmp_case.SparseBatch`).
"""

import pytest
import torch

from distcache import CacheConfig
from tests.gpu.common import CUDA_REASON

DEVICE = torch.device("cuda")
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason=CUDA_REASON
)


def _case():
    """The TorchRec side, imported only where TorchRec is installed."""
    pytest.importorskip("torchrec")
    from tests.gpu import dmp_case

    return dmp_case


def _train_plain(model, dense_params, batches, device) -> list[torch.Tensor]:
    """Non-pipelined training: forward, backward (rows updated in it), dense SGD step."""
    dense = torch.optim.SGD(dense_params, lr=1.0)
    logits = []
    for batch in batches:
        loss, out = model(batch.to(device))
        dense.zero_grad()
        loss.backward()
        dense.step()
        logits.append(out.cpu())
    return logits


def _reference_run(case, state, batches):
    """The uncached twin trained the same way (sparse SGD on the tables, SGD on the layer)."""
    ref = case.ReferenceModel(state)
    opt = torch.optim.SGD(list(ref.parameters()), lr=1.0)
    logits = []
    for batch in batches:
        loss, out = ref(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        logits.append(out)
    weights = {
        f"ebc.embedding_bags.{n}.weight": b.weight.detach()
        for (n, *_), b in zip(case.TABLES, ref.bags, strict=True)
    }
    return logits, weights, ref.dense.weight.detach()


def _assert_equal_runs(mine, expected, what: str) -> None:
    for step, (a, b) in enumerate(zip(mine, expected, strict=True)):
        assert torch.equal(a, b), f"{what}: step {step} differs"


@pytest.mark.parametrize(
    ("capacity", "policy", "graphs", "staging", "fused"),
    [(24, "lookahead", None, None, False), (24, "lru", None, None, False),
     (1.0, "lookahead", None, None, False), (24, "lookahead", False, "worker", False),
     (24, "lookahead", None, None, True), (24, "lru", None, None, True)],
    # None: the defaults (on CUDA graphs, direct staging); fused: `CacheConfig.fused`
)  # fmt: skip
def test_dmp_training_equals_uncached_embedding_bags_bitwise(
    capacity, policy, graphs, staging, fused
):
    case = _case()
    state = case.integer_state()
    batches = case.batches(30, batch_size=6, seed=1)
    ref_logits, ref_weights, ref_dense = _reference_run(case, state, batches)
    config = CacheConfig(
        capacity=capacity, lookahead=2, prefetch_depth=1, policy=policy, cuda_graphs=graphs,
        staging=staging, fused=fused,
    )  # fmt: skip
    dmp, dense_params = case.sharded(state, config, DEVICE)
    logits = _train_plain(dmp, dense_params, batches, DEVICE)
    _assert_equal_runs(logits, ref_logits, "DMP vs uncached")
    weights = case.table_weights(dmp)
    assert weights.keys() == ref_weights.keys()
    for key, expected in ref_weights.items():
        assert torch.equal(weights[key], expected), key
    assert torch.equal(dense_params[0].detach().cpu(), ref_dense)
    stats = case.total_stats(dmp)
    if capacity != 1.0:
        assert stats["loads"] > 0, stats
        assert stats["evictions"] > 0 and stats["writebacks"] > 0, stats
    else:  # every row loaded before the first batch (`Stager.load_all`), none by a batch
        assert stats["loads"] == stats["evictions"] == 0, stats
    assert (stats["graph_replays"] > 0) == config.graphs_on(DEVICE), stats


def test_lookahead_pipeline_equals_plain_loop_bitwise_without_critical_misses():
    from distcache.pipeline import LookaheadTrainPipeline

    case = _case()
    state = case.integer_state()
    batches = case.batches(40, batch_size=6, seed=2)
    ref_logits, ref_weights, _ = _reference_run(case, state, batches)
    config = CacheConfig(capacity=40, lookahead=3, prefetch_depth=2)
    runs = {}
    for name in ("plain", "pipeline"):
        dmp, dense_params = case.sharded(state, config, DEVICE)
        if name == "plain":
            logits = _train_plain(dmp, dense_params, batches, DEVICE)
        else:
            dense = torch.optim.SGD(dense_params, lr=1.0)
            pipeline = LookaheadTrainPipeline(dmp, dense, DEVICE)
            it = iter(batches)
            logits = []
            while True:
                try:
                    logits.append(pipeline.progress(it).cpu())
                except StopIteration:
                    break
            total = pipeline.stats()["total"]
            assert total["trained_batches"] == len(batches)
            assert total["critical_misses"] == 0, total
            assert total["loads"] > 0 and total["evictions"] > 0 and total["writebacks"] > 0
        runs[name] = (logits, case.table_weights(dmp))
    (plain, plain_w), (piped, piped_w) = runs["plain"], runs["pipeline"]
    _assert_equal_runs(piped, plain, "pipeline vs plain loop")
    _assert_equal_runs(piped, ref_logits, "pipeline vs uncached")
    for key, expected in ref_weights.items():
        assert torch.equal(piped_w[key], expected), key
        assert torch.equal(plain_w[key], expected), key


@pytest.mark.parametrize("prefetch", [False, True])
def test_torchrecs_pipelines_equal_uncached_bitwise(prefetch):
    """TorchRec's own pipelines over distcache's kernel on CUDA, each routing the next batch on
    a stream of its own and training on the current one: `TrainPipelineSparseDist` (each batch
    staged when it is looked up) and `PrefetchTrainPipelineSparseDist` (its pipeline for
    FBGEMM's UVM cache, which hands batch i + 1's routed ids to the sharded module's `prefetch`
    on its prefetch stream, between batch i's forward and backward). The same bits as the
    uncached twin; the prefetch one without a critical-path miss. (On CPU, with their streams
    emulated: tests/distributed/test_pipeline.py.)"""
    case = _case()
    from torchrec.distributed.train_pipeline import (
        PrefetchTrainPipelineSparseDist,
        TrainPipelineSparseDist,
    )

    from tests.distributed.prefetch_pipeline import cpu_record_stream

    state = case.integer_state()
    batches = case.batches(40, batch_size=6, seed=3)
    ref_logits, ref_weights, _ = _reference_run(case, state, batches)
    dmp, dense_params = case.sharded(state, CacheConfig(capacity=40, lookahead=3), DEVICE)
    dense = torch.optim.SGD(dense_params, lr=1.0)
    pipeline_type = PrefetchTrainPipelineSparseDist if prefetch else TrainPipelineSparseDist
    pipeline = pipeline_type(dmp, dense, DEVICE)
    it, logits = iter(batches), []
    with cpu_record_stream():  # the batches' sparse features stay on the host (`dmp_case`)
        while True:
            try:
                logits.append(pipeline.progress(it).cpu())
            except StopIteration:
                break
    _assert_equal_runs(logits, ref_logits, f"TorchRec's pipeline (prefetch={prefetch}) vs uncached")
    weights = case.table_weights(dmp)
    for key, expected in ref_weights.items():
        assert torch.equal(weights[key], expected), key
    stats = case.total_stats(dmp)
    assert stats["loads"] > 0, stats
    assert (stats["critical_misses"] == 0) == prefetch, stats
