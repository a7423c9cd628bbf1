"""The cache engine on CUDA: same results as on CPU (skipped without a GPU)."""

import pytest
import torch

from distcache import CacheConfig, CachedEmbeddingBags
from tests.unit.cache.reference import (
    ReferenceBags,
    integer_weights,
    loss_of,
    make_batches,
    make_tables,
    reference_optimizer,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("policy", ["lookahead", "lru"])
def test_cuda_training_equals_cpu_reference_bitwise(policy):
    tables = make_tables([8, 8, 4], [300, 200, 100])
    weights = integer_weights(tables, 0)
    config = CacheConfig(
        capacity=60, lookahead=4, prefetch_depth=2, policy=policy, learning_rate=1.0
    )
    cached = CachedEmbeddingBags(tables, config, device="cuda")
    for t, w in zip(tables, weights, strict=True):
        cached.load_table_weight(t.name, w)
    ref = ReferenceBags(tables, weights)
    opt = reference_optimizer(config, ref.parameters())
    batches = make_batches(tables, batch_size=8, num_batches=30, max_len=3, seed=0)
    enqueued = 0
    for t, (values, offsets) in enumerate(batches):
        while enqueued < len(batches) and enqueued <= t + config.lookahead:
            cached.enqueue(*batches[enqueued])
            enqueued += 1
        cached.prefetch()
        out = cached(values, offsets)
        cached.prefetch()
        loss_of(out).backward()
        opt.zero_grad()
        ref_out = ref(values, offsets)
        loss_of(ref_out).backward()
        opt.step()
        assert torch.equal(out.detach().cpu(), ref_out.detach()), f"step {t}"
    for t, bag in zip(tables, ref.bags, strict=True):
        assert torch.equal(cached.table_weight(t.name), bag.weight.data)
    stats = cached.stats().values()
    assert all(s.writebacks > 0 for s in stats)
    if policy == "lookahead":
        assert all(s.critical_misses == 0 for s in stats)
