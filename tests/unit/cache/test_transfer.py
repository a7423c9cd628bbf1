"""Direct staging: row copies bounded by a count on the device, and the engine staging with them.

`copy_rows` is checked against a plain loop, on its torch path (what CPU runs) and, where Triton
is installed, its Triton kernel under Triton's interpreter (what CUDA runs, compiled). The engine
with `staging="direct"` must train exactly as with the worker thread and as uncached tables.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from distcache import CacheConfig, CachedEmbeddingBags
from distcache.cache.transfer import _triton_kernel, copy_rows, device_view, triton_copy_rows
from distcache.errors import DistcacheConfigError
from tests.unit.cache.reference import (
    ReferenceBags,
    integer_weights,
    loss_of,
    make_batches,
    make_tables,
    reference_optimizer,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _case(dtype: torch.dtype, width: int, count: int):
    gen = torch.Generator().manual_seed(width + count)
    src = torch.randn(30, width, generator=gen).to(dtype)
    dst = torch.randn(12, width, generator=gen).to(dtype)
    size = 8
    src_rows = torch.randperm(29, generator=gen)[:size]  # row 29: the source's trash
    dst_rows = torch.randperm(11, generator=gen)[:size]  # row 11: the destination's trash
    expected = dst.clone()
    for i in range(count):
        expected[dst_rows[i]] = src[src_rows[i]]
    return src, src_rows, dst, dst_rows, torch.tensor([count]), expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("width", "count"), [(5, 3), (16, 0), (16, 8), (33, 5)])
def test_copy_rows_copies_exactly_the_counted_entries(dtype, width, count):
    src, src_rows, dst, dst_rows, count_t, expected = _case(dtype, width, count)
    copy_rows(src, src_rows, dst, dst_rows, count_t, src_trash=29, dst_trash=11)
    # Every row but the trash is as a loop over the first `count` entries leaves it.
    assert torch.equal(dst[:11], expected[:11])


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize(("width", "count"), [(5, 3), (16, 0), (16, 8), (33, 5), (128, 7)])
def test_the_triton_kernel_copies_the_counted_entries_and_nothing_else(width, count):
    """The kernel CUDA runs, interpreted on the CPU: entries from `count` on touch no row, the
    trash row included."""
    src, src_rows, dst, dst_rows, count_t, expected = _case(torch.float32, width, count)
    triton_copy_rows(_triton_kernel(interpret=True), src, src_rows, dst, dst_rows, count_t)
    assert torch.equal(dst, expected)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize(("width", "programs"), [(16, 1), (16, 3), (1024, 2), (40, 64)])
def test_a_few_triton_programs_stride_over_every_counted_entry(width, programs):
    """Fewer programs than entries (each copies `ROWS` rows a step, then strides on): every
    entry below the count is copied once, the others not at all."""
    gen = torch.Generator().manual_seed(width)
    src, dst = torch.randn(700, width, generator=gen), torch.randn(600, width, generator=gen)
    src_rows, dst_rows = torch.randperm(700, generator=gen)[:500], torch.randperm(600)[:500]
    count = 437
    expected = dst.clone()
    expected[dst_rows[:count]] = src[src_rows[:count]]
    kernel = _triton_kernel(interpret=True)
    triton_copy_rows(kernel, src, src_rows, dst, dst_rows, torch.tensor([count]), programs=programs)
    assert torch.equal(dst, expected)


def test_copy_rows_needs_no_value_on_the_host():
    """Under FakeTensorMode (tensors without data: any read of a value raises)."""
    with FakeTensorMode():
        src, dst = torch.zeros(30, 8), torch.zeros(12, 8)
        rows = torch.randint(0, 11, (8,))
        copy_rows(src, rows, dst, rows, torch.tensor([3]), src_trash=29, dst_trash=11)


def test_copy_rows_refuses_rows_of_another_shape():
    with pytest.raises(DistcacheConfigError, match="cannot go to rows of"):
        copy_rows(
            torch.zeros(4, 3), torch.zeros(2, dtype=torch.long), torch.zeros(4, 5),
            torch.zeros(2, dtype=torch.long), torch.tensor([1]), src_trash=3, dst_trash=3,
        )  # fmt: skip


def test_a_cpu_device_view_is_the_host_tensor():
    rows = torch.zeros(4, 3)
    assert device_view(rows, torch.device("cpu")) is rows


def _train(staging: str, optimizer: str, depth: int):
    tables = make_tables([4, 4], [60, 40], ["sum", "mean"])
    weights = integer_weights(tables, 0)
    config = CacheConfig(
        capacity=20, lookahead=4, prefetch_depth=depth, learning_rate=1.0 if optimizer ==
        "sgd" else 0.1, optimizer=optimizer, staging=staging,
    )  # fmt: skip
    cached = CachedEmbeddingBags(tables, config)
    for table, weight in zip(tables, weights, strict=True):
        cached.load_table_weight(table.name, weight)
    ref = ReferenceBags(tables, weights)
    opt = reference_optimizer(config, ref.parameters())
    batches = make_batches(tables, batch_size=4, num_batches=40, max_len=3, seed=5)
    outs, enqueued = [], 0
    for t, batch in enumerate(batches):
        while enqueued < len(batches) and enqueued <= t + config.lookahead:
            cached.enqueue(*batches[enqueued])
            enqueued += 1
        cached.prefetch()
        out = cached(*batch)
        cached.prefetch()  # the next batch's rows move while this one trains
        loss_of(out).backward()
        opt.zero_grad()
        loss_of(ref(*batch)).backward()
        opt.step()
        outs.append(out.detach())
    return cached, ref, outs


@pytest.mark.parametrize(("optimizer", "depth"), [("sgd", 1), ("adam", 2), ("rowwise_adagrad", 0)])
def test_direct_staging_trains_as_the_worker_and_as_uncached_tables(optimizer, depth):
    """Bitwise: the outputs of every step, the rows after a flush (the host store), the
    counters, with the cache evicting and writing dirty rows back."""
    direct, ref, direct_outs = _train("direct", optimizer, depth)
    worker, _, worker_outs = _train("worker", optimizer, depth)
    for t, (a, b) in enumerate(zip(direct_outs, worker_outs, strict=True)):
        assert torch.equal(a, b), f"step {t}"
    counters = ("loads", "writebacks", "evictions", "hits", "critical_misses")
    for a, b in zip(direct.stats().values(), worker.stats().values(), strict=True):
        assert [getattr(a, c) for c in counters] == [getattr(b, c) for c in counters]
        assert a.writebacks > 0
    direct.flush()
    worker.flush()
    for i, table in enumerate(("t0", "t1")):
        rows = direct.table_weight(table)
        assert torch.equal(rows, worker.table_weight(table)), table
        if optimizer == "sgd" and table == "t0":  # integer weights, sums, lr 1: exact
            assert torch.equal(rows, ref.bags[i].weight.data), table
        elif optimizer == "sgd":  # t1 pools by mean: FBGEMM sums a row's gradient, then
            # steps once; nn.EmbeddingBag's sparse SGD steps id by id (last bits differ)
            torch.testing.assert_close(rows, ref.bags[i].weight.data)
    for a, b in zip(direct.engines, worker.engines, strict=True):
        moved = (a.store.rows_read, a.store.rows_written)
        assert moved == (b.store.rows_read, b.store.rows_written) and min(moved) > 0
