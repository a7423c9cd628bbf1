"""`sharding.hot_reduce.Reduction`: the gradient rows of the replicas' hot ids summed over gloo
ranks, all rows all-reduced or only the touched rows all-gathered, against the reference: each
rank's rows added into a dense gradient, all-reduced."""

import pytest
import torch
import torch.distributed as dist

from distcache.sharding.hot_reduce import Reduction, Span, sum_by_key
from distcache.tools.collectives import CollectiveBytes
from tests.distributed.harness import run_ranks

# Two widths (dims 4 and 8); tables (name, width, first row in it, rows).
TABLES = [("a", 0, 0, 5), ("b", 0, 5, 7), ("c", 1, 0, 3), ("d", 1, 3, 6)]
WIDTHS = [(12, 4), (9, 8)]  # (rows, dim)


def _case(rank: int, world: int, touched_only: tuple[bool, ...]) -> None:
    spans = [
        Span(name, w, row, rows, WIDTHS[w][1], gather)
        for (name, w, row, rows), gather in zip(TABLES, touched_only, strict=True)
    ]
    reduction = Reduction(spans, [r for r, _ in WIDTHS], dist.new_group(backend="gloo"))
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * step + rank)
        entries, dense, flags = [], [], []
        for width, (rows, dim) in enumerate(WIDTHS):
            # Ids with repeats; rank 2 touches none of width 1 at step 1.
            n = 0 if (step == 1 and rank == 2 and width == 1) else 4 + 5 * rank
            ids = torch.randint(0, rows, (n,), generator=gen)
            grads = torch.randn(n, dim, generator=gen)
            entries.append((width, ids, grads))
            dense.append(torch.zeros(rows, dim).index_add_(0, ids, grads))
            flags.append(torch.zeros(rows).index_fill_(0, ids, 1.0))
        counts = [int(flags[s.width][s.row : s.row + s.rows].sum()) for s in reduction.gathered]
        reduction.expect(counts)
        with CollectiveBytes() as counted:  # what `compare --measure` reports
            pending = reduction.start(entries)
        reduced = reduction.finish(pending)
        # The touched rows' all-gather is counted as the replicas' own, not as an all-to-all.
        assert counted.all_to_all == 0.0, counted.all_to_all
        assert (counted.hot_gather > 0) == any(touched_only), counted.hot_gather
        assert (counted.all_reduce > 0) == (not all(touched_only)), counted.all_reduce
        for width in range(len(WIDTHS)):
            dist.all_reduce(dense[width])
            dist.all_reduce(flags[width])
        for s in spans:
            want = dense[s.width][s.row : s.row + s.rows]
            used = flags[s.width][s.row : s.row + s.rows] > 0
            if not s.touched_only:
                got, got_used = reduced.whole[s.name]
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
                assert torch.equal(got_used, used), (step, s)
                continue
            keys, sums = reduced.rows[s.width]
            rows = WIDTHS[s.width][0]
            valid = keys < rows
            assert len(set(keys[valid].tolist())) == int(valid.sum()), "a row sent twice"
            got = torch.zeros(rows + 1, s.dim).index_copy_(0, keys, sums)[s.row : s.row + s.rows]
            got_used = torch.zeros(rows + 1, dtype=torch.bool).index_fill_(0, keys, True)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            assert torch.equal(got_used[s.row : s.row + s.rows], used), (step, s)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "touched_only",
    [(True, True, True, True), (False, True, True, False), (False, False, False, False)],
)
def test_reduction_equals_an_all_reduce_of_dense_gradients(touched_only):
    run_ranks(_case, 3, args=(touched_only,), timeout_s=90)


def test_sum_by_key_sums_runs_and_pads_with_the_sentinel():
    keys = torch.tensor([3, 1, 3, 9, 0, 1])  # 9: the sentinel
    values = torch.arange(12, dtype=torch.float32).view(6, 2)
    unique, sums = sum_by_key(keys, values, 9)
    assert unique.tolist() == [0, 1, 3, 9, 9, 9]
    expected = [[8, 9], [2 + 10, 3 + 11], [0 + 4, 1 + 5], [6, 7], [0, 0], [0, 0]]
    assert sums.tolist() == expected


def test_one_process_needs_no_group():
    spans = [Span("a", 0, 0, 4, 2, True), Span("b", 0, 4, 2, 2, False)]
    reduction = Reduction(spans, [6], None)
    rows = torch.tensor([0, 2, 0, 5])
    grads = torch.tensor([[1.0, 1], [2, 2], [3, 3], [4, 4]])
    reduction.expect([2])
    reduced = reduction.finish(reduction.start([(0, rows, grads)]))
    keys, sums = reduced.rows[0]
    assert keys[:2].tolist() == [0, 2] and sums[:2].tolist() == [[4.0, 4], [2, 2]]
    grad, used = reduced.whole["b"]
    assert grad.tolist() == [[0.0, 0], [4, 4]] and used.tolist() == [False, True]
