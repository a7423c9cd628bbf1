"""`cuda_graphs` on CUDA: the scheduler's work captured in CUDA graphs trains bitwise as without
them (and as the CPU engine), and the replayed per-batch path does not synchronize.

The CPU tests (`tests/unit/cache/test_graphs.py`) run the same flow with an emulated graph; this
checks what only CUDA has: the capture itself (every op capturable, nothing reading back), and
replays that read their inputs from the graph's buffers. SGD with integer weights, lr 1 and
sum pooling: exact in fp32 whatever order CUDA's index_add_ sums in.
"""

from __future__ import annotations

import pytest
import torch

from distcache import CacheConfig, CachedEmbeddingBags
from tests.gpu.common import CUDA_REASON, train_without_syncs
from tests.unit.cache.reference import make_tables
from tests.unit.cache.test_graphs import batches_of, train

DEVICE = torch.device("cuda")
TABLES = make_tables([4, 4], [300, 200])  # sum pooling: exact sums in any order
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason=CUDA_REASON
)


@pytest.mark.parametrize(("policy", "depth", "staging"), [
    ("lookahead", 1, "worker"), ("lookahead", 2, "direct"), ("lru", 0, "worker"),
])  # fmt: skip
def test_cuda_graphs_train_bitwise_as_without(policy, depth, staging):
    batches = batches_of([6] * 20 + [4] * 12 + [6] * 20, pooling=2, seed=1, tables=TABLES)
    config = dict(
        capacity=40, lookahead=4, prefetch_depth=depth, policy=policy, learning_rate=1.0,
        staging=staging,
    )  # fmt: skip
    run = dict(reset_at=40, tables=TABLES)
    cpu, cpu_outs, _ = train(CacheConfig(**config), batches, **run)
    plain, plain_outs, _ = train(CacheConfig(**config), batches, device=DEVICE, **run)
    graphed, graphed_outs, _ = train(
        CacheConfig(**config, cuda_graphs=True), batches, device=DEVICE, **run
    )
    for t, (a, b, c) in enumerate(zip(cpu_outs, plain_outs, graphed_outs, strict=True)):
        assert torch.equal(a, b) and torch.equal(b, c), f"step {t}"
    for table in TABLES:
        rows = graphed.table_weight(table.name).cpu()
        assert torch.equal(rows, plain.table_weight(table.name).cpu())
        assert torch.equal(rows, cpu.table_weight(table.name).cpu())
    counters = ("loads", "writebacks", "evictions", "hits", "critical_misses")
    for a, b in zip(plain.stats().values(), graphed.stats().values(), strict=True):
        assert [getattr(a, c) for c in counters] == [getattr(b, c) for c in counters]
        assert a.evictions > 0
    graphs = graphed.engines[0].scheduler.graphs
    assert graphs.captures >= 4 and graphs.replays > 40


def test_replayed_path_does_not_synchronize():
    """After the captures (a synchronization each, once per batch size), enqueue, prefetch,
    forward and backward under `set_sync_debug_mode("error")`."""
    batches = batches_of([6] * 40, 2, seed=4, tables=TABLES)
    config = CacheConfig(capacity=40, lookahead=4, prefetch_depth=1, cuda_graphs=True)
    cached = CachedEmbeddingBags(TABLES, config, device=DEVICE)
    train_without_syncs(cached, batches, lookahead=config.lookahead, warm=20)  # (evicting by then)
    assert cached.engines[0].scheduler.graphs.replays > 20 and cached._router.graphs.replays > 20
    assert all(s.evictions > 0 for s in cached.stats().values())
