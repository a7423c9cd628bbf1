"""The C kernels of the fused passes (`fused_native`): their build, their guard on arguments,
and the sort only they have. (What they compute is compared with the torch ops, pass by pass
and through training, in `test_fused.py`.)"""

from __future__ import annotations

import subprocess

import pytest
import torch

from distcache import CacheConfig, CachedEmbeddingBags
from distcache.cache import fused, fused_native, select
from distcache.cache.ids import find_invalid_per_feature
from distcache.errors import DistcacheConfigError, DistcacheError
from tests.unit.cache.reference import make_tables

native = pytest.mark.skipif(fused_native.load() is None, reason="no C compiler built them")


def _sort(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = ids.numel()
    ordered, order, count = torch.empty_like(ids), torch.empty(n, dtype=torch.int64), ids.clone()
    scratch = (torch.empty_like(ids), torch.empty_like(order))
    fused_native.load()["sort"][(1,)](ids, ordered, order, count, *scratch, n, 2**31 - 1)
    return ordered, order, count


@native
@pytest.mark.parametrize(
    "ids",
    [
        torch.zeros(0, dtype=torch.int32),
        torch.tensor([7], dtype=torch.int32),
        torch.full((300,), 5, dtype=torch.int32),  # one value: every digit shared
        torch.tensor([2**31 - 1, 0, 2**31 - 1, 3, 2**20, 0], dtype=torch.int32),  # every digit
        torch.randint(0, 1_000_000, (13_312,), dtype=torch.int32),
        torch.randint(1 << 22, (1 << 22) + 50, (5_000,), dtype=torch.int32),  # shared high bits
    ],
)
def test_the_sort_orders_as_torch_keeps_equal_ids_in_order_and_counts_them(ids):
    ordered, order, count = _sort(ids)
    assert torch.equal(ordered, torch.sort(ids).values)
    first = torch.ones_like(ordered)
    first[1:] = (ordered[1:] != ordered[:-1]).int()
    assert torch.equal(count, first.cumsum(0, dtype=torch.int32))  # distinct ids so far
    assert torch.equal(ids[order], ordered)
    assert torch.equal(order.sort().values, torch.arange(ids.numel()))  # a permutation
    same = ordered[1:] == ordered[:-1]
    assert bool((order[1:][same] > order[:-1][same]).all())  # stable


@native
def test_a_kernel_refuses_arguments_it_would_misread():
    move = fused_native.load()["move"][(1,)]
    src, dst, rows = torch.arange(8.0).view(4, 2), torch.zeros(4, 2), torch.tensor([3, 0])
    move(src, rows, dst, rows, 2, 8, BLOCK=1024)  # (constexprs it has no use for: ignored)
    assert dst.tolist() == [[0, 1], [0, 0], [0, 0], [6, 7]]
    with pytest.raises(DistcacheError, match="argument 1 is a torch.int32 tensor"):
        move(src, rows.int(), dst, rows, 2, 8)
    with pytest.raises(DistcacheError, match="contiguous: False"):
        move(src, torch.arange(4)[::2], dst, rows, 2, 8)
    with pytest.raises(DistcacheError, match="5 arguments, expected 6"):
        move(src, rows, dst, rows, 2)
    with pytest.raises(DistcacheError, match="argument 2 is on meta, not the CPU"):
        move(src, rows, dst.to("meta"), rows, 2, 8)


@native
def test_the_build_is_kept_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "cc -O1")  # (a compiler with flags of its own)
    library = fused_native._built()
    assert library.parent == tmp_path / "distcache" and library.exists()
    assert not list(library.parent.glob("*.partial"))  # (renamed into place)

    def no_compiler(*args, **kwargs):  # noqa: ANN002, ANN003
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert fused_native._built() == library


def test_a_compiler_that_fails_is_named_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(DistcacheError, match="false failed"):
        fused_native._built()
    assert not list((tmp_path / "distcache").iterdir())
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(OSError):
        fused_native._built()


@native
def test_an_unwritable_cache_falls_back_to_the_next_folder(tmp_path, monkeypatch):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the folder would be")
    monkeypatch.setattr(fused_native, "_folders", lambda: [blocked / "distcache", tmp_path / "b"])
    assert fused_native._built().parent == tmp_path / "b"
    monkeypatch.setattr(fused_native, "_folders", lambda: [blocked / "distcache"])
    with pytest.raises(DistcacheError, match="no writable folder"):
        fused_native._built()


@native
@pytest.mark.parametrize("seed", range(6))
def test_the_one_pass_selection_picks_as_the_torch_ops(seed):
    """`fused.select_counted` with the C kernels (the boundary found from the top class down)
    against `select.select_counted`: ties, pinned keys (-1), wanting none, more than the
    candidates, and a result shorter than the selection."""
    gen = torch.Generator().manual_seed(seed)
    classes, m = [4, 64, 300][seed % 3], [1, 50, 2000][seed // 2 % 3]
    keys = torch.randint(-1, classes, (m,), generator=gen, dtype=torch.int32)
    hist = torch.zeros(classes + 1, dtype=torch.int32).index_add_(
        0, (keys + 1).long(), torch.ones(m, dtype=torch.int32)
    )
    for want in sorted({0, 1, m // 3, m - 1, m, m + 2}):
        for size in sorted({1, want + 1, m + 1}):
            want_t = torch.tensor(want)
            expected = select.select_counted(keys, hist, classes, want_t, size)
            got = fused.select_counted(fused_native.load(), keys, hist, classes, want_t, size)
            for name, a, b in zip(("picked", "taken", "candidates"), expected, got, strict=True):
                assert torch.equal(a, b), f"want {want}, size {size}: {name}"


@native
@pytest.mark.parametrize("pooled", [True, False])
@pytest.mark.parametrize("weighted", [True, False])
def test_the_sgd_step_is_the_torch_ops_bit_for_bit(pooled, weighted):
    """`fused.sgd` against `CacheEngine.apply_gradients`'s torch ops on fp32 rows: random
    gradients and weights, an lr that rounds, slots that repeat (duplicates, padding), a
    gradient that is not contiguous."""
    gen = torch.Generator().manual_seed(int(pooled) * 2 + int(weighted))
    slots, dim, n, bags = 40, 16, 3000, 500
    weights = torch.randn(slots, dim, generator=gen)
    bag_grad = torch.randn(dim, bags, generator=gen).t()  # (not contiguous)
    id_slots = torch.randint(0, slots, (n,), generator=gen)
    bag_of_id = torch.randint(0, bags, (n,), generator=gen) if pooled else None
    grad = bag_grad if pooled else torch.randn(n, dim, generator=gen)
    id_weights = torch.rand(n, generator=gen) if weighted else None
    lr = 0.0137
    step = grad * -lr
    if bag_of_id is not None:
        step = step.index_select(0, bag_of_id)
    if id_weights is not None:
        step = step * id_weights.unsqueeze(1)
    expected = weights.clone().index_add_(0, id_slots, step)
    fused.sgd(fused_native.load(), weights, grad, bag_of_id, id_weights, id_slots, lr)
    assert torch.equal(weights, expected)


@native
def test_the_id_check_is_the_torch_ops():
    """`fused.check` against `ids.find_invalid_per_feature` and the replacement by 0: ids out of
    range both ways, a feature without ids, the last feature's ids."""
    rows = torch.tensor([10, 3, 7, 5])
    ids_per_feature = torch.tensor([4, 0, 5, 3])
    values = torch.tensor([0, 9, 10, -1, 6, 7, 0, 2, -5, 4, 5, 1])
    bad, count = find_invalid_per_feature(values, ids_per_feature, rows)
    checked, got = fused.check(fused_native.load(), values, ids_per_feature, rows)
    assert torch.equal(checked, torch.where(bad, 0, values))
    assert torch.equal(got, count) and got.tolist() == [5]


@native
def test_rows_move_as_index_copy_moves_them():
    """`fused.move`: rows of any dtype (here fp16 and float32 of two widths), by row lists;
    tables whose rows differ are refused."""
    load = fused_native.load()
    for dtype, dim in ((torch.float16, 8), (torch.float32, 3)):
        src = torch.randn(50, dim).to(dtype)
        dst = torch.zeros(20, dim, dtype=dtype)
        rows, slots = torch.tensor([7, 0, 49, 12]), torch.tensor([3, 19, 0, 4])
        expected = dst.clone().index_copy_(0, slots, src.index_select(0, rows))
        fused.move(load, src, rows, dst, slots)
        assert torch.equal(dst, expected)
    with pytest.raises(DistcacheConfigError, match="cannot move"):
        fused.move(
            load, torch.zeros(4, 8), rows[:1], torch.zeros(4, 8, dtype=torch.float16), rows[:1]
        )


@native
def test_unchecked_ids_out_of_range_are_routed_to_the_sentinel_row():
    """Without `check_ids` the torch ops index out of range later and raise; the C kernels
    have no bounds check to fail, so their routing sends such ids to the sentinel row, and
    training goes on without reading or writing outside the maps."""
    tables = make_tables([4], [30])
    config = CacheConfig(capacity=10, lookahead=2, check_ids=False, cuda_graphs=False)
    cached = CachedEmbeddingBags(tables, config)
    values, offsets = torch.tensor([3, 30, -2, 5, 1 << 40]), torch.tensor([0, 2, 3, 5])
    routed = cached._router.route_device(values, offsets)
    sentinel = cached._groups[0].sentinel_row
    assert routed[0].tolist() == [3, sentinel, sentinel, 5, sentinel]
    for _ in range(3):
        cached.enqueue(values, offsets)
    cached.prefetch()
    cached(values, offsets).sum().backward()


@native
@pytest.mark.parametrize("capacity", [10, 1.0])  # evicting, and a cache of every row
def test_unchecked_rows_out_of_range_enter_the_window_as_the_sentinel_row(capacity):
    """Tables of two widths route by the torch ops (one group each), which pass unchecked ids
    on unchanged; the C kernels' sort and a cache of every row's entry take an engine row out
    of range as the sentinel row instead of addressing outside the window's maps."""
    tables = make_tables([4, 8], [30, 20])
    config = CacheConfig(capacity=capacity, lookahead=2, check_ids=False, cuda_graphs=False)
    cached = CachedEmbeddingBags(tables, config)
    assert len(cached.engines) == 2
    values, offsets = torch.tensor([3, 100, -40, 5, 1 << 33]), torch.tensor([0, 1, 3, 4, 5])
    for _ in range(3):
        cached.enqueue(values, offsets)
    for _ in range(3):
        cached.prefetch()
        cached(values, offsets).sum().backward()
