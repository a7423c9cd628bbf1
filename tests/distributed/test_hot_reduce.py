"""`sharding.hot_reduce.Reduction`: the replicas' gradient summed over gloo ranks, whole or only
the touched rows, against a plain all-reduce of every row (the reference)."""

import pytest
import torch
import torch.distributed as dist

from distcache.sharding.hot_reduce import Reduction, Span
from tests.distributed.harness import run_ranks

# Three tables side by side in one flat replica (dims 4, 4, 8): rows, first row, start.
SPANS = [(5, 0, 0, 4), (7, 5, 20, 4), (3, 12, 48, 8)]


def _case(rank: int, world: int, modes: tuple[bool, ...]) -> None:
    spans = [Span(r, n, start, d, m) for (n, r, start, d), m in zip(SPANS, modes, strict=True)]
    rows = sum(s.rows for s in spans)
    size = sum(s.rows * s.dim for s in spans)
    reduction = Reduction(spans, dist.new_group(backend="gloo"))
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * step + rank)
        # Each rank touches a different number of rows (rank 2 none of the last table at step 1).
        touched = torch.rand(rows, generator=gen) < 0.3 + 0.2 * rank
        if step == 1 and rank == 2:
            touched[12:] = False
        grad = torch.randn(size, generator=gen) * torch.cat(
            [touched[s.row : s.row + s.rows].repeat_interleave(s.dim).float() for s in spans]
        )  # untouched rows have a zero gradient, as in a backward
        reduction.expect([int(touched[s.row : s.row + s.rows].sum()) for s in reduction.gathered])
        summed = reduction.finish(reduction.start(grad, touched))
        want, flags = grad.clone(), touched.float()
        dist.all_reduce(want)
        dist.all_reduce(flags)
        for s, (got, used) in zip(spans, summed, strict=True):
            expected = want[s.start : s.start + s.rows * s.dim].view(s.rows, s.dim)
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
            assert torch.equal(used, flags[s.row : s.row + s.rows] > 0), (step, s)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("modes", [(True, True, True), (False, True, False), (False, False, False)])
def test_reduction_equals_an_all_reduce_of_every_row(modes):
    run_ranks(_case, 3, args=(modes,), timeout_s=90)


def test_one_process_needs_no_group():
    spans = [Span(0, 4, 0, 2, True), Span(4, 2, 8, 2, False)]
    reduction = Reduction(spans, None)
    grad = torch.arange(12, dtype=torch.float32)
    touched = torch.tensor([True, False, True, False, False, True])
    reduction.expect([2])
    (g0, u0), (g1, u1) = reduction.finish(reduction.start(grad, touched))
    assert torch.equal(g0, torch.tensor([[0.0, 1.0], [0, 0], [4, 5], [0, 0]]))  # rows 1, 3 not sent
    assert u0.tolist() == [True, False, True, False]
    assert torch.equal(g1, grad[8:].view(2, 2)) and u1.tolist() == [False, True]
