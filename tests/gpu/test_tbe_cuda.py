"""FBGEMM's TBE over the cache's slots on CUDA (`CacheConfig.kernel='fbgemm'`, where fbgemm_gpu's
CUDA build is installed): it trains as the torch kernel (bitwise where the
arithmetic is exact), padded groups, weighted features, half rows and per-id rows included, and
its lookups and fused updates do not synchronize the host with the device."""

import pytest
import torch

from distcache import CacheConfig, CachedEmbeddingBags
from distcache.cache import tbe
from distcache.cache.optimizers import make_optimizer
from tests.gpu.common import CUDA_REASON, to_device
from tests.unit.cache.reference import loss_of, make_batches, make_tables
from tests.unit.cache.test_tbe import check_bags_kernels_agree, check_rows_kernels_agree

DEVICE = torch.device("cuda")
_NO_TBE = tbe.tbe_unsupported(
    optimizer="sgd", dim=8, dtype=torch.float32, device=DEVICE
) if torch.cuda.is_available() else None  # fmt: skip
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON),
    pytest.mark.skipif(_NO_TBE is not None, reason=f"FBGEMM's CUDA TBE: {_NO_TBE}"),
]


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("weighted", [False, True])
def test_tbe_on_cuda_trains_as_the_torch_kernel(optimizer, dtype, weighted):
    for pooling in ("sum", "mean"):
        check_bags_kernels_agree(optimizer, dtype, pooling, weighted, device=DEVICE)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_tbe_per_id_rows_on_cuda_train_as_the_torch_kernel(optimizer):
    check_rows_kernels_agree(optimizer, padded=True, device=DEVICE)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad"])
def test_a_fresh_tbe_reads_nothing_back(optimizer):
    """From its first lookup (FBGEMM's wrapper would read the device's step counter once)."""
    config = CacheConfig(optimizer=optimizer, learning_rate=0.1)
    kernel = tbe.TbeKernel(
        slots=66, dim=8, dtype=torch.float32, config=config,
        optimizer=make_optimizer(config), device=DEVICE, pooled=True,
    )  # fmt: skip
    slots = torch.randint(0, 64, (40,), device=DEVICE)
    offsets = torch.arange(0, 41, 4, device=DEVICE)
    torch.cuda.synchronize(DEVICE)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            out = kernel.lookup(slots, offsets, padded=True)  # padding bags too
            kernel.update(out, torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_steady_state_tbe_path_does_not_synchronize(optimizer):
    """enqueue, prefetch, forward (FBGEMM's) and backward (its fused update) under
    `set_sync_debug_mode("error")`, with the cache evicting."""
    tables = make_tables([8, 8, 4], [3000, 2000, 1000], ["sum", "mean", "sum"])
    config = CacheConfig(
        capacity=120, lookahead=4, prefetch_depth=1, optimizer=optimizer, kernel="fbgemm"
    )
    bags = CachedEmbeddingBags(tables, config, device=DEVICE)
    assert [e.kernel for e in bags.engines] == ["fbgemm", "fbgemm"]
    batches = make_batches(tables, batch_size=16, num_batches=30, max_len=3, seed=1)
    gen = torch.Generator().manual_seed(2)
    weights = [torch.rand(v.numel(), generator=gen).to(DEVICE) for v, _ in batches]
    on_device = [to_device(b, DEVICE) for b in batches]
    enqueued = 0
    try:
        for t, batch in enumerate(on_device):
            if t == 12:  # warm: caches full, graphs captured
                torch.cuda.synchronize(DEVICE)
                torch.cuda.set_sync_debug_mode("error")
            while enqueued < len(batches) and enqueued <= t + config.lookahead:
                bags.enqueue(*on_device[enqueued])
                enqueued += 1
            bags.prefetch()
            out = bags(*batch, weights[t])
            bags.prefetch()
            loss_of(out).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(s.writebacks > 0 for s in bags.stats().values())
