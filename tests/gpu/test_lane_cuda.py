"""`scheduler_thread` on CUDA: the scheduler's calls on a thread of their own, with CUDA's
defaults (graphs, direct staging where Triton is installed), train bitwise as on the training
thread, and neither thread synchronizes once the graphs are captured.

What only CUDA has: the lane thread's current stream (the caller's, then the schedule stream),
its graph captures while the training thread launches (thread-local capture mode), and the
events between the two threads' streams. `tests/unit/cache/test_lane.py` runs the flow on CPU.
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
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)


@pytest.mark.parametrize("policy", ["lookahead", "lru"])
def test_a_scheduler_thread_trains_bitwise_as_the_training_thread(policy):
    batches = batches_of([6] * 20 + [4] * 12 + [6] * 20, pooling=2, seed=1, tables=TABLES)
    depth = 2 if policy == "lookahead" else 0
    config = dict(capacity=40, lookahead=4, prefetch_depth=depth, policy=policy, learning_rate=1.0)
    run = dict(reset_at=40, tables=TABLES, device=DEVICE)
    inline, inline_outs, _ = train(CacheConfig(**config), batches, **run)
    lane, lane_outs, _ = train(CacheConfig(**config, scheduler_thread=True), batches, **run)
    for t, (a, b) in enumerate(zip(inline_outs, lane_outs, strict=True)):
        assert torch.equal(a, b), f"step {t}"
    for table in TABLES:
        assert torch.equal(
            inline.table_weight(table.name).cpu(), lane.table_weight(table.name).cpu()
        )
    counters = ("loads", "writebacks", "evictions", "hits", "critical_misses", "graph_replays")
    for a, b in zip(inline.stats().values(), lane.stats().values(), strict=True):
        assert [getattr(a, c) for c in counters] == [getattr(b, c) for c in counters]
        assert a.evictions > 0 and a.graph_replays > 0


def test_neither_thread_synchronizes_once_captured():
    """After the captures, enqueue, prefetch, forward and backward under
    `set_sync_debug_mode("error")` (process-wide: the lane thread's calls too)."""
    batches = batches_of([6] * 40, 2, seed=4, tables=TABLES)
    config = CacheConfig(
        capacity=40, lookahead=4, prefetch_depth=1, cuda_graphs=True, scheduler_thread=True
    )
    cached = CachedEmbeddingBags(TABLES, config, device=DEVICE)
    train_without_syncs(cached, batches, lookahead=config.lookahead, warm=20)
    assert cached.engines[0].scheduler.graphs.replays > 20
    assert all(s.evictions > 0 for s in cached.stats().values())
