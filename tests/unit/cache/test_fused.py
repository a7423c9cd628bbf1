"""The scheduler's fused passes (`CacheConfig.fused`) against the torch ops they replace.

Two schedulers see the same batches, one with the torch ops (the reference), one with the fused
kernels: every plan and every piece of state they keep must be equal, bit for bit, batch after
batch, through filling, eviction, dirty write-backs, batches with padding and duplicate rows,
and batches of changing sizes. On CPU each comparison runs twice: with the C kernels
(`fused_native`, what a CPU runs) and with Triton's kernels under its interpreter (what CUDA
compiles).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from distcache import CacheConfig, CachedEmbeddingBags
from distcache.cache import fused, fused_native
from distcache.cache.policies import make_policy
from distcache.cache.scheduler import Scheduler
from distcache.cache.sequence import CachedEmbeddings
from distcache.errors import DistcacheConfigError
from tests.unit.cache.reference import integer_weights, loss_of, make_batches, make_tables

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_NATIVE = fused_native.load() is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")


@pytest.fixture(params=["native", "triton"])
def cpu_kernels(request, monkeypatch) -> str:
    """The fused kernels a CPU device gets (`fused.CPU_KERNELS`): the C ones, then Triton's
    interpreted."""
    if request.param == "native" and not HAS_NATIVE:
        pytest.skip("no C compiler built the C kernels")
    if request.param == "triton" and not HAS_TRITON:
        pytest.skip("Triton is not installed")
    monkeypatch.setattr(fused, "CPU_KERNELS", request.param)
    return request.param


_PLAN = ("slots", "id_slots", "load_rows", "load_slots", "writeback_rows", "writeback_slots")


def _state(s: Scheduler) -> dict[str, torch.Tensor]:
    """Everything the scheduler keeps, less the trash entries (masked writes land there: the
    torch ops write them, the kernels skip them) and the sentinel slot's pin count, use count
    and next use (the torch ops count a pin and a use there for every row without a slot of
    its own, which the kernels leave, and an overflowing batch's rows write their next uses
    there, in an order only the torch ops keep). Nothing reads any of them."""
    res, win = s.residency, s.window
    state = {
        "slot_of": res.slot_of,
        "row_of": res.row_of,
        "dirty": res.dirty,
        "pin": res.pin[: res.capacity],
        "next_use": res.next_use[: res.capacity],
        "latest": win.latest,
        "ring": win.next_use[: win.ring_size],
        "totals": s._totals,
    }
    slot_state = {f"policy.{k}": v for k, v in vars(s.policy).items() if torch.is_tensor(v)}
    state.update({k: v[: res.capacity] if k == "policy.uses" else v for k, v in slot_state.items()})
    per_row, per_slot = res.num_rows + 2, res.capacity + 2
    return {
        name: t[:-1] if t.numel() in (per_row, per_slot) and name != "ring" else t
        for name, t in state.items()
    }


def _assert_same(ref: Scheduler, got: Scheduler, where: str) -> None:
    for name, tensor in _state(ref).items():
        other = _state(got)[name]
        assert torch.equal(tensor, other), f"{where}: {name} differs"


def _pair(
    rows: int,
    capacity: int,
    policy: str,
    lookahead: int,
    *,
    device: str = "cpu",
    graphs: bool = False,
) -> tuple[Scheduler, Scheduler]:
    """Schedulers with the torch ops and with the fused kernels (`graphs`: both replay)."""
    return tuple(
        Scheduler(
            rows, capacity, make_policy(policy), lookahead=lookahead, device=device,
            graphs=graphs, fused=f,
        )
        for f in (False, True)
    )  # fmt: skip


def _batches(rows: int, sizes: list[int], seed: int) -> list[torch.Tensor]:
    """Power-law ids with duplicates, some of them the sentinel row (padding, invalid ids)."""
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, rows + 2, dtype=torch.float64)
    return [torch.multinomial(weights, n, replacement=True, generator=gen) for n in sizes]


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize(
    ("policy", "capacity", "lookahead", "sizes"),
    [
        ("lookahead", 60, 4, [50] * 30),  # small: fills, then evicts every batch
        ("lookahead", 400, 8, [37, 300, 5, 128, 1, 90] * 5),  # changing sizes
        ("lru", 80, 3, [64] * 25),
        ("lookahead", 1000, 2, [200] * 12),  # a cache of every row (`_stage_whole`)
        ("lookahead", 4800, 4, [300] * 90),  # sweeps part of the cache (`Victims`, `MIN_SCAN`)
        ("lookahead", 61, 4, [50] * 20 + [400] * 3 + [50] * 5),  # batches that overflow it
    ],
)
def test_the_fused_scheduler_plans_and_keeps_state_as_the_torch_ops(
    policy, capacity, lookahead, sizes
):
    run_pair(policy, capacity, lookahead, sizes, device="cpu", graphs=False)


def run_pair(policy, capacity, lookahead, sizes, *, device, graphs) -> None:  # noqa: ANN001
    """Both schedulers through `sizes`' batches, compared after every entry and every plan
    (also `tests/gpu/test_fused_cuda.py`'s, with the compiled kernels)."""
    rows = {400: 2000, 1000: 1000, 4800: 20_000}.get(capacity, 500)
    ref, got = _pair(rows, capacity, policy, lookahead, device=device, graphs=graphs)
    batches = [b.to(device) for b in _batches(rows, sizes, seed=capacity)]
    fed = 0
    for s in (ref, got):
        if s.needs_fill:
            s.fill_whole()
    for t in range(len(batches)):
        while fed < len(batches) and fed <= t + lookahead:
            seqs = [s.enqueue(batches[fed]) for s in (ref, got)]
            assert seqs[0] == seqs[1]
            fed += 1
            _assert_same(ref, got, f"batch {fed - 1} entered")
        plans = [s.stage_next() for s in (ref, got)]
        for name in _PLAN:
            a, b = (getattr(p, name) for p in plans)
            assert torch.equal(a, b), f"batch {t}: plan.{name} differs"
        assert torch.equal(plans[0].counts, plans[1].counts), f"batch {t}: counts differ"
        assert torch.equal(plans[0].inverse, plans[1].inverse)
        for s, plan in zip((ref, got), plans, strict=True):
            s.note_counts(plan.counts.tolist())
            s.release(plan, updated=t % 3 != 0)
        _assert_same(ref, got, f"batch {t} staged")
    assert ref.counters == got.counters
    assert capacity == 1000 or ref.counters.evictions > 0


@pytest.mark.usefixtures("cpu_kernels")
def test_a_batch_without_ids_enters_the_fused_window():
    ref, got = _pair(100, 20, "lookahead", 2)
    for s in (ref, got):
        s.enqueue(torch.zeros(0, dtype=torch.int64))
    _assert_same(ref, got, "an empty batch entered")


def test_fused_with_graph_emulation_on_cpu_is_refused():
    with pytest.raises(DistcacheConfigError, match="cuda_graphs=False on CPU"):
        fused.kernels(torch.device("cpu"), graphs=True)


def test_fused_without_triton_or_a_compiler_says_so(monkeypatch):
    monkeypatch.setattr(fused, "_kernels", lambda *, interpret: None)
    monkeypatch.setattr(fused_native, "load", lambda: None)
    with pytest.raises(DistcacheConfigError, match="needs a C compiler"):
        fused.kernels(torch.device("cpu"))
    with pytest.raises(DistcacheConfigError, match="needs Triton"):
        fused.kernels(torch.device("cuda"))
    assert not CacheConfig().fused_on(torch.device("cpu"))  # the default then runs torch ops


def test_the_default_is_the_c_kernels_on_cpu_and_the_torch_ops_on_cuda():
    config = CacheConfig()
    assert config.fused_on(torch.device("cpu")) == HAS_NATIVE
    assert not config.fused_on(torch.device("cuda"))  # (not measured on a GPU yet)
    assert not CacheConfig(cuda_graphs=True).fused_on(torch.device("cpu"))  # (emulation)
    assert not CacheConfig(fused=False).fused_on(torch.device("cpu"))
    assert CacheConfig(fused=True).fused_on(torch.device("cuda"))
    if HAS_NATIVE:
        assert fused.kernels(torch.device("cpu")) is fused_native.load()


@pytest.mark.usefixtures("cpu_kernels")
def test_cached_bags_with_the_fused_scheduler_train_as_without():
    """Through `CacheConfig.fused`: the outputs of every step and the rows after a flush are
    those of the torch ops, bitwise, with the cache evicting and writing dirty rows back."""
    compare_training("cpu")


def compare_training(device: str) -> None:
    """`CachedEmbeddingBags` with and without `fused` on `device` (its defaults there) trains
    alike (also `tests/gpu/test_fused_cuda.py`'s)."""
    runs = [_train_bags(f, device) for f in (False, True)]
    for t, (a, b) in enumerate(zip(runs[0][1], runs[1][1], strict=True)):
        assert torch.equal(a, b), f"step {t}"
    (ref, _), (got, _) = runs
    counters = ("loads", "writebacks", "evictions", "hits", "unique", "critical_misses")
    a, b = ([getattr(next(iter(c.stats().values())), k) for k in counters] for c in (ref, got))
    assert a == b and a[1] > 0
    for c in (ref, got):
        c.flush()
    for table in ("t0", "t1"):
        assert torch.equal(ref.table_weight(table), got.table_weight(table)), table


def _train_bags(fused_passes: bool, device: str):
    tables = make_tables([4, 4], [60, 40], ["sum", "mean"])
    config = CacheConfig(capacity=20, lookahead=4, learning_rate=0.5, fused=fused_passes)
    cached = CachedEmbeddingBags(tables, config, device=device)
    for table, weight in zip(tables, integer_weights(tables, 0), strict=True):
        cached.load_table_weight(table.name, weight)
    batches = make_batches(tables, batch_size=4, num_batches=30, max_len=3, seed=5)
    batches = [tuple(x.to(device) for x in batch) for batch in batches]
    return cached, _train_window(cached, batches, loss_of)


def _train_window(cached: CachedEmbeddingBags, batches: list, loss) -> list[torch.Tensor]:  # noqa: ANN001
    """Train `cached` on `batches` with `loss`, L batches enqueued ahead; each step's output."""
    outs, enqueued = [], 0
    for t, batch in enumerate(batches):
        while enqueued < len(batches) and enqueued <= t + cached.config.lookahead:
            cached.enqueue(*batches[enqueued])
            enqueued += 1
        cached.prefetch()
        out = cached(*batch)
        loss(out).backward()
        outs.append(out.detach().cpu())
    return outs


@pytest.mark.skipif(not HAS_NATIVE, reason="no C compiler built the C kernels")
def test_bags_pooled_into_the_output_train_as_the_torch_ops_to_the_bit():
    """One cache of every feature, in order: the C kernels pool its bags straight into the
    output and read its gradient there (`fused.pool`, `fused.sgd`'s `batch_major`). Rows of
    random floats, so the order of every float operation shows: outputs at every step and the
    rows after a flush equal the torch ops' (`embedding_bag`, the transposes), bit for bit,
    through sum and mean bags, several ids a bag, eviction and write-back."""
    runs = [_train_float_bags(f) for f in (False, True)]
    (ref, ref_outs), (got, got_outs) = runs
    assert got._groups[0].engine.pool_kernels is not None and len(got._groups) == 1
    for t, (a, b) in enumerate(zip(ref_outs, got_outs, strict=True)):
        assert torch.equal(a, b), f"step {t}"
    for c in (ref, got):
        c.flush()
    for table in ("t0", "t1"):
        assert torch.equal(ref.table_weight(table), got.table_weight(table)), table


def _train_float_bags(fused_passes: bool):
    tables = make_tables([8, 8], [300, 200], ["sum", "mean"])
    config = CacheConfig(capacity=60, lookahead=4, learning_rate=0.37, fused=fused_passes)
    cached = CachedEmbeddingBags(tables, config)
    gen = torch.Generator().manual_seed(0)
    for table in tables:
        shape = (table.num_embeddings, table.embedding_dim)
        cached.load_table_weight(table.name, torch.randn(shape, generator=gen))
    batches = make_batches(tables, batch_size=16, num_batches=40, max_len=5, seed=7)
    outs = _train_window(
        cached, batches, lambda out: (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
    )
    assert next(iter(cached.stats().values())).evictions > 0
    return cached, outs


@pytest.mark.parametrize("padded_ids", [False, True])
@pytest.mark.parametrize("check_ids", [True, False])
def test_the_fused_routing_matches_the_torch_ops(padded_ids, check_ids, cpu_kernels):
    # (unchecked ids out of range: the C kernels route them to the sentinel row, having no
    # bounds check to fail later; the torch ops and Triton's route them unchanged)
    compare_routing("cpu", padded_ids, check_ids, unchecked_to_sentinel=cpu_kernels == "native")


def compare_routing(
    device: str, padded_ids: bool, check_ids: bool, *, unchecked_to_sentinel: bool = False
) -> None:
    """A batch routed by the one-group kernel and by the torch ops: each id's engine row (the
    sentinel row for invalid ids and padding), its bag, the bags' divisors and the count of
    invalid ids; jagged bags, empty ones, and ids out of range both ways (also
    `tests/gpu/test_fused_cuda.py`'s). `unchecked_to_sentinel`: the kernel routes ids out of
    range to the sentinel row without `check_ids` too."""
    tables = make_tables([4, 4, 4], [30, 7, 50], ["sum", "mean", "sum"])
    config = CacheConfig(capacity=1.0, check_ids=check_ids, cuda_graphs=False)
    modules = [
        CachedEmbeddingBags(tables, dataclasses.replace(config, fused=f), device=device)
        for f in (False, True)
    ]
    lengths = torch.tensor([2, 0, 3, 1, 1, 4, 0, 2, 3, 1, 1, 2])  # 3 features x 4 samples
    values = torch.tensor([3, 29, 0, 6, 7, 1, 2, 6, -1, 4, 5, 7, 50, 10, 0, 12, 13, 0, 30, 1])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    if padded_ids:  # ids past the last bag (what graphs pad with)
        values = torch.cat([values, torch.zeros(5, dtype=torch.long)])
    values, offsets = values.to(device), offsets.to(device)
    ref, got = (m._router.route_device(values, offsets, padded_ids=padded_ids) for m in modules)
    assert len(ref) == len(got)
    if unchecked_to_sentinel and not check_ids:
        bound = torch.tensor([30] * 6 + [7] * 7 + [50] * 7 + [1] * (values.numel() - 20))
        out = (values < 0) | (values >= bound.to(device))  # (padding: value 0, in range)
        assert out.sum().item() == 3  # -1, 7 and 50 of table 1 (7 rows)
        ref = (torch.where(out, modules[0]._groups[0].sentinel_row, ref[0]), *ref[1:])
    for k, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert torch.equal(a, b), f"output {k}"
    if check_ids:
        assert got[-1].tolist() == [3]  # -1, 7 and 50 of table 1 (7 rows)


@needs_triton
def test_the_compiled_kernels_specialize_on_their_constexprs_only():
    """A CUDA graph captures a pass with its inputs at other addresses (and alignments) than
    the warm-up call that compiled its kernels; a kernel specialized on an int's value or a
    pointer's alignment would compile again inside the capture. (Built, not launched: no GPU
    needed.)"""
    from distcache.cache import fused_kernels

    for name, kernel in fused_kernels.build(interpret=False).items():
        for p in kernel.params:
            assert p.is_constexpr or (p.do_not_specialize and p.do_not_specialize_on_alignment), (
                f"{name}.{p.name}"
            )


@pytest.mark.usefixtures("cpu_kernels")
def test_cached_sequences_with_the_fused_scheduler_train_as_without():
    """`CachedEmbeddings` (per-id rows, TorchRec's EmbeddingCollection) routes and stages
    through the same passes: each step's rows and the flushed tables, bitwise."""
    tables = make_tables([4, 4], [60, 40], ["sum", "sum"])
    batches = make_batches(tables, batch_size=4, num_batches=20, max_len=3, seed=7)
    runs = []
    for fused_passes in (False, True):
        config = CacheConfig(capacity=20, lookahead=3, learning_rate=0.5, fused=fused_passes)
        seqs = CachedEmbeddings(tables, config)
        for table, weight in zip(tables, integer_weights(tables, 0), strict=True):
            seqs.load_table_weight(table.name, weight)
        outs = []
        for t, batch in enumerate(batches):
            if t == 0:
                for ahead in batches[: config.lookahead + 1]:
                    seqs.enqueue(*ahead)
            elif t + config.lookahead < len(batches):
                seqs.enqueue(*batches[t + config.lookahead])
            seqs.prefetch()
            rows = seqs(*batch)
            (rows * rows).sum().backward()
            outs.append(rows.detach())
        seqs.flush()
        runs.append((outs, [seqs.table_weight(t.name).clone() for t in tables]))
    for t, (a, b) in enumerate(zip(runs[0][0], runs[1][0], strict=True)):
        assert torch.equal(a, b), f"step {t}"
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        assert torch.equal(a, b)
