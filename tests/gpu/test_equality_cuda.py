"""DESIGN invariant 5 on CUDA: training through the cache equals training without it, and the
CUDA engine equals the CPU engine bitwise (outputs, final rows, and every cache counter).

Bitwise where fp32 is exact: SGD with integer weights, integer gradients and lr 1. Row-wise
Adagrad is compared within float tolerance (CUDA's index_add_ sums in any order).
"""

import pytest
import torch

from distcache import CacheConfig, CachedEmbeddingBags
from distcache.cache.policies import make_policy
from distcache.cache.scheduler import Scheduler
from distcache.cache.select import select_largest
from distcache.data.traces import zipf_trace
from tests.gpu.common import CUDA_REASON, counters, train_windowed
from tests.unit.cache.reference import (
    ReferenceBags,
    integer_weights,
    loss_of,
    make_batches,
    make_tables,
    reference_optimizer,
)

DEVICE = torch.device("cuda")
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason=CUDA_REASON
)

# Two widths: t0 and t1 share one cache (one engine), t2 has its own.
TABLES = make_tables([8, 8, 4], [300, 200, 100])
BATCHES = make_batches(TABLES, batch_size=8, num_batches=40, max_len=3, seed=0)


def _cached(config: CacheConfig, device: torch.device):
    cached = CachedEmbeddingBags(TABLES, config, device=device)
    for t, w in zip(TABLES, integer_weights(TABLES, 0), strict=True):
        cached.load_table_weight(t.name, w)
    return cached


def _reference(config: CacheConfig) -> tuple[ReferenceBags, list[torch.Tensor]]:
    """The same tables uncached (`nn.EmbeddingBag`, torch optimizer), on the CPU."""
    ref = ReferenceBags(TABLES, integer_weights(TABLES, 0))
    opt = reference_optimizer(config, ref.parameters())
    outs = []
    for values, offsets in BATCHES:
        out = ref(values, offsets)
        opt.zero_grad()
        loss_of(out).backward()
        opt.step()
        outs.append(out.detach())
    return ref, outs


@pytest.mark.parametrize("policy", ["lookahead", "lru"])
@pytest.mark.parametrize(
    ("capacity", "depth", "lookahead"),
    [(24, 1, 4), (40, 2, 4), (40, 2, 32), (0.3, 1, 4), (1.0, 1, 4)],
)
def test_cuda_equals_cpu_engine_and_reference_bitwise(policy, capacity, depth, lookahead):
    config = CacheConfig(
        capacity=capacity,
        lookahead=lookahead,
        prefetch_depth=depth,
        policy=policy,
        learning_rate=1.0,
    )
    ref, ref_outs = _reference(config)
    runs = {}
    for device in (DEVICE, torch.device("cpu")):
        cached = _cached(config, device)
        outs = train_windowed(cached, BATCHES, lookahead=config.lookahead)
        weights = {t.name: cached.table_weight(t.name).clone() for t in TABLES}
        runs[device.type] = (outs, weights, counters(cached))
    (outs, weights, stats), (cpu_outs, cpu_weights, cpu_stats) = runs[DEVICE.type], runs["cpu"]
    for step, (mine, cpu, expected) in enumerate(zip(outs, cpu_outs, ref_outs, strict=True)):
        assert torch.equal(mine, expected), f"step {step}: {DEVICE} output differs from reference"
        assert torch.equal(mine, cpu), f"step {step}: {DEVICE} output differs from the CPU engine"
    for t, bag in zip(TABLES, ref.bags, strict=True):
        assert torch.equal(weights[t.name], bag.weight.data), t.name
        assert torch.equal(weights[t.name], cpu_weights[t.name]), t.name
    # The schedule itself is device-independent: same hits, loads, write-backs, evictions.
    assert stats == cpu_stats
    if capacity != 1.0:
        assert all(s["evictions"] > 0 and s["writebacks"] > 0 for s in stats.values()), stats
    if policy == "lookahead" or capacity == 1.0:  # (a cache of every row never misses)
        assert all(s["critical_misses"] == 0 for s in stats.values()), stats
    else:
        assert all(s["critical_misses"] > 0 for s in stats.values()), stats


def test_rowwise_adagrad_on_cuda_matches_reference_within_tolerance():
    config = CacheConfig(
        capacity=40, lookahead=4, prefetch_depth=2, optimizer="rowwise_adagrad", learning_rate=0.1
    )
    ref, ref_outs = _reference(config)
    cached = _cached(config, DEVICE)
    outs = train_windowed(cached, BATCHES, lookahead=config.lookahead)
    for step, (mine, expected) in enumerate(zip(outs, ref_outs, strict=True)):
        torch.testing.assert_close(mine, expected, msg=f"step {step}")
    for t, bag in zip(TABLES, ref.bags, strict=True):
        torch.testing.assert_close(cached.table_weight(t.name), bag.weight.data)
    assert all(s["writebacks"] > 0 for s in counters(cached).values())


@pytest.mark.parametrize("n", [0, 1, 100, 3000, 20000, 100_000])
def test_select_largest_on_cuda_equals_cpu(n):
    """The victim selection picks the same slots on both devices (ties to the lower index)."""
    gen = torch.Generator().manual_seed(n)
    keys = torch.randint(-1, 500, (100_000,), generator=gen, dtype=torch.int64)  # many ties
    want = torch.tensor(n)
    expected = select_largest(keys, 500, want, 100_000)
    got = select_largest(keys.to(DEVICE), 500, want.to(DEVICE), 100_000)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("policy", ["lookahead", "lru", "lfu"])
def test_scheduler_plans_on_cuda_equal_cpu(policy):
    """At a size where the cache evicts every batch: every plan of a zipf trace is the same on
    both devices (the batch's slots, loads, write-backs, counts)."""
    rows, capacity, batch, lookahead = 50_000, 12_000, 2048, 4
    trace = zipf_trace(rows=rows, alpha=1.05, batch=batch, batches=30, seed=0)
    plans = {}
    for device in (DEVICE, torch.device("cpu")):
        sched = Scheduler(rows, capacity, make_policy(policy), lookahead=lookahead, device=device)
        got = []
        enqueued = 0
        for t in range(trace.num_batches):
            while enqueued < trace.num_batches and enqueued <= t + lookahead:
                sched.enqueue(trace.batch(enqueued).to(device))
                enqueued += 1
            plan = sched.stage_next()
            sched.release(plan)  # as if the batch trained: its rows are dirty
            got.append(
                [
                    x.cpu()
                    for x in (
                        plan.id_slots,
                        plan.load_rows,
                        plan.load_slots,
                        plan.writeback_rows,
                        plan.counts,
                    )
                ]
            )
        plans[device.type] = got
    assert sched.counters.evictions > 0
    for step, (mine, cpu) in enumerate(zip(plans[DEVICE.type], plans["cpu"], strict=True)):
        names = ("id_slots", "load_rows", "load_slots", "writeback_rows", "counts")
        for name, a, b in zip(names, mine, cpu, strict=True):
            assert torch.equal(a, b), f"step {step}: {name} differs"
