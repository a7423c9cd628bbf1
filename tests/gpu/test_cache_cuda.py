"""The cache engine on CUDA: same results as on CPU (skipped without a GPU)."""

import pytest
import torch

from distcache import CacheConfig, CachedEmbeddingBags
from distcache.cache import tbe
from tests.unit.cache.reference import (
    ReferenceBags,
    integer_weights,
    loss_of,
    make_batches,
    make_tables,
    reference_optimizer,
    train_both,
    updated_below_half_a_gap,
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


@pytest.mark.parametrize("sequence", [False, True])
@pytest.mark.parametrize("staging", ["worker", "direct"])
def test_an_evaluation_between_steps_reads_beside_the_window_on_cuda(staging, sequence):
    """An evaluation between training steps, batches staged ahead, reads each row where it
    is (a slot, or the pinned host rows through their device view): bitwise the CPU
    reference's outputs, and training goes on as the reference's, with no critical miss."""
    tables = make_tables([8, 8, 8], [300, 200, 100])
    config = CacheConfig(
        capacity=60, lookahead=4, prefetch_depth=2, learning_rate=1.0, staging=staging
    )
    batches = make_batches(tables, batch_size=8, num_batches=20, max_len=3, seed=0)
    others = make_batches(tables, batch_size=5, num_batches=2, max_len=3, seed=7)
    evaluate = {3: others[0], 9: batches[10], 14: others[1]}
    cached, ref, pairs = train_both(
        tables, config, batches, weights=integer_weights(tables, 0), sequence=sequence,
        evaluate=evaluate, device="cuda",
    )  # fmt: skip
    assert len(pairs) == len(batches) + len(evaluate)
    for step, (out, ref_out) in enumerate(pairs):
        assert torch.equal(out.cpu(), ref_out), f"output {step}"
    refs = ref.embs if sequence else ref.bags
    for t, module in zip(tables, refs, strict=True):
        assert torch.equal(cached.table_weight(t.name), module.weight.data)
    assert all(s.critical_misses == 0 for s in cached.stats().values())


@pytest.mark.parametrize("kernel", ["torch", "fbgemm"])
def test_half_rows_are_rounded_stochastically_by_default_on_cuda(kernel):
    """As FBGEMM's CUDA kernels (TorchRec's `fused`) do by default: fp16 rows updated by a
    sixteenth of the gap to the next value each step follow fp32 SGD on average."""
    cuda = torch.device("cuda")
    reason = tbe.tbe_unsupported(optimizer="sgd", dim=8, dtype=torch.float16, device=cuda)
    if kernel == "fbgemm" and reason is not None:
        pytest.skip(reason)
    moved, error, gap = updated_below_half_a_gap(
        CacheConfig(capacity=64, kernel=kernel), torch.float16, "cuda"
    )
    assert abs(error.mean().item()) < gap / 4 and (moved != 0).any()
