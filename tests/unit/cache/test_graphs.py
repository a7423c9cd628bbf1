"""`cuda_graphs`: the scheduler's device work captured per batch size and replayed.

On CPU the graphs are `CPUGraph`s, which replay the ops they recorded on the same tensors, as a
CUDA graph replays its kernels: Python code in the captured function runs once, host values are
baked in. So these tests check the flow a GPU runs: training with graphs is bitwise the training
without (every policy, both stagings, batches of two sizes, an error and a reset in between),
and the per-batch path still reads nothing back.
"""

from __future__ import annotations

import pytest
import torch

from distcache import CacheConfig, CachedEmbeddingBags, CachedEmbeddings
from distcache.cache.graphs import CPUGraph, GraphCache, padded_size
from distcache.cache.policies import make_policy
from distcache.cache.scheduler import Scheduler
from distcache.errors import CacheCapacityError, DistcacheConfigError, InvalidIdError
from tests.device_audit import SyncAudit
from tests.unit.cache.reference import integer_weights, loss_of, make_batches, make_tables

TABLES = make_tables([4, 4], [300, 200], ["sum", "mean"])


def batches_of(batch_sizes: list[int], pooling: int, seed: int, tables=TABLES):  # noqa: ANN001
    """Batches of `pooling` power-law ids a bag (so every batch of a size has as many ids)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for b in batch_sizes:
        values = []
        for t in tables:
            u = torch.rand(b * pooling, generator=gen, dtype=torch.float64)
            rank = (t.num_embeddings**u).long() - 1  # alpha 1: hot rows repeat
            values.append((rank.clamp(0, t.num_embeddings - 1) * 7919) % t.num_embeddings)
        offsets = torch.arange(0, len(tables) * b * pooling + 1, pooling)
        out.append((torch.cat(values), offsets))
    return out


def train(  # noqa: ANN201
    config: CacheConfig,
    batches,  # noqa: ANN001
    *,
    reset_at: int | None = None,
    device: str | torch.device = "cpu",
    module: type[CachedEmbeddingBags] = CachedEmbeddingBags,
    tables=TABLES,  # noqa: ANN001
    id_weights: list[torch.Tensor] | None = None,
):
    """Trains `batches` as the pipeline does (L ahead); a batch whose lookup raises
    `CacheCapacityError` or `InvalidIdError` is skipped (the window was dropped; it is
    refilled); `reset_at`: the caches are flushed and reset before that step; `id_weights`:
    each batch's per-id weights. Returns the module, the outputs of every step (on the host)
    and the errors."""
    cached = module(tables, config, device=device)
    for table, weight in zip(tables, integer_weights(tables, 0), strict=True):
        cached.load_table_weight(table.name, weight)
    outs, enqueued, errors = [], 0, []
    for t, batch in enumerate(batches):
        if t == reset_at:
            cached.flush()
            cached.reset()
            enqueued = t
        while enqueued < len(batches) and enqueued <= t + config.lookahead:
            cached.enqueue(*batches[enqueued])
            enqueued += 1
        cached.prefetch()
        try:
            out = cached(*batch) if id_weights is None else cached(*batch, id_weights[t])
        except (CacheCapacityError, InvalidIdError) as err:
            errors.append((t, str(err)))
            enqueued = t + 1  # the window was dropped: the failed batch is skipped
            continue
        cached.prefetch()
        loss_of(out).backward()
        outs.append(out.detach().cpu())
    cached.flush()
    return cached, outs, errors


def assert_same_training(plain, plain_outs, graphed, graphed_outs, tables=TABLES) -> None:  # noqa: ANN001
    """Bitwise: every step's output, and every table's rows after training."""
    for t, (a, b) in enumerate(zip(plain_outs, graphed_outs, strict=True)):
        assert torch.equal(a, b), f"step {t}"
    for table in tables:
        assert torch.equal(plain.table_weight(table.name), graphed.table_weight(table.name))


@pytest.mark.parametrize(
    ("policy", "optimizer", "depth", "staging"),
    [
        ("lookahead", "sgd", 1, "worker"),
        ("lookahead", "adam", 2, "direct"),
        ("lru", "rowwise_adagrad", 0, "worker"),
        ("lfu", "sgd", 0, "direct"),
    ],
)
def test_graphs_train_bitwise_as_without(policy, optimizer, depth, staging):
    sizes = [6] * 20 + [4] * 12 + [6] * 20  # two sizes: two keys each, captured and replayed
    batches = batches_of(sizes, pooling=2, seed=1)
    config = dict(
        capacity=40, lookahead=4, prefetch_depth=depth, policy=policy, optimizer=optimizer,
        learning_rate=1.0 if optimizer == "sgd" else 0.1, staging=staging,
    )  # fmt: skip
    plain, plain_outs, _ = train(CacheConfig(**config), batches, reset_at=40)
    graphed, graphed_outs, _ = train(CacheConfig(**config, cuda_graphs=True), batches, reset_at=40)
    assert_same_training(plain, plain_outs, graphed, graphed_outs)
    counters = ("loads", "writebacks", "evictions", "hits", "critical_misses")
    for a, b in zip(plain.stats().values(), graphed.stats().values(), strict=True):
        assert [getattr(a, c) for c in counters] == [getattr(b, c) for c in counters]
        assert a.evictions > 0 and a.writebacks > 0
    (engine,) = graphed.engines
    graphs = engine.scheduler.graphs
    assert graphs.captures >= 4 and graphs.replays > 40  # 2 sizes x enqueue, stage; after reset
    routing = graphed._router.graphs
    assert routing.captures == 2 and routing.replays > 40  # the routing's
    assert plain.engines[0].scheduler.graphs.captures == 0


def test_graphs_are_captured_again_when_the_window_grows():
    """Bigger batches make the window's ring grow (a new tensor, which the graphs captured):
    they are dropped and captured again, and training stays bitwise as without graphs."""
    batches = batches_of([6] * 20, pooling=2, seed=8) + batches_of([40] * 20, pooling=4, seed=9)
    config = dict(capacity=0.9, lookahead=4, prefetch_depth=1, learning_rate=1.0)
    plain, plain_outs, _ = train(CacheConfig(**config), batches)
    graphed, graphed_outs, _ = train(CacheConfig(**config, cuda_graphs=True), batches)
    assert_same_training(plain, plain_outs, graphed, graphed_outs)
    scheduler = graphed.engines[0].scheduler
    assert scheduler.window.generation > 0  # the ring grew
    assert scheduler.graphs.captures >= 4 and scheduler.graphs.replays > 20
    assert all(s.evictions > 0 for s in graphed.stats().values())


def test_jagged_batches_are_padded_to_a_few_sizes_and_replayed():
    """Batches of changing sizes (0-3 ids a bag) are padded with the sentinel row to a few
    sizes; training is bitwise as without graphs (and without padding)."""
    batches = make_batches(TABLES, batch_size=8, num_batches=60, max_len=3, seed=6)
    assert len({values.numel() for values, _ in batches}) > 10
    config = dict(capacity=40, lookahead=4, prefetch_depth=1, learning_rate=1.0)
    plain, plain_outs, _ = train(CacheConfig(**config), batches)
    graphed, graphed_outs, _ = train(CacheConfig(**config, cuda_graphs=True), batches)
    assert_same_training(plain, plain_outs, graphed, graphed_outs)
    for a, b in zip(plain.stats().values(), graphed.stats().values(), strict=True):
        assert (a.ids, a.unique, a.loads, a.evictions) == (b.ids, b.unique, b.loads, b.evictions)
    assert graphed.engines[0].scheduler.graphs.replays > 40
    assert graphed._router.graphs.replays > 30  # the routing, padded too


@pytest.mark.parametrize("case", ["two widths, weighted", "per-id rows"])
def test_jagged_padded_routing_is_bitwise_as_without(case):
    """The routing padded past a jagged batch's ids: groups that hold some features only (their
    ids packed), per-id weights, per-id rows (`CachedEmbeddings`), against no graphs."""
    sequence = case == "per-id rows"
    tables = make_tables([4, 4], [300, 200]) if sequence else make_tables([4, 8], [300, 200])
    module = CachedEmbeddings if sequence else CachedEmbeddingBags
    batches = make_batches(tables, batch_size=8, num_batches=50, max_len=3, seed=10)
    gen = torch.Generator().manual_seed(11)
    weights = None if sequence else [torch.rand(v.numel(), generator=gen) for v, _ in batches]
    config = dict(capacity=40, lookahead=3, prefetch_depth=1, learning_rate=0.5)
    run = dict(module=module, tables=tables, id_weights=weights)
    plain, plain_outs, _ = train(CacheConfig(**config), batches, **run)
    graphed, graphed_outs, _ = train(CacheConfig(**config, cuda_graphs=True), batches, **run)
    assert_same_training(plain, plain_outs, graphed, graphed_outs, tables)
    assert graphed._router.graphs.replays > 20
    assert all(e.scheduler.graphs.replays > 20 for e in graphed.engines)


def test_padded_sizes_are_few_and_at_most_a_quarter_more():
    sizes = [padded_size(n) for n in range(1, 100_000)]
    assert all(p >= n and p <= max(16, 1.25 * n) for n, p in enumerate(sizes, start=1))
    assert sizes == sorted(sizes)
    assert len(set(sizes[1000:2000])) <= 5  # 1,001 .. 2,000 ids: four or five sizes


def test_batches_of_one_size_are_not_padded():
    scheduler = Scheduler(500, 100, make_policy("lookahead"), lookahead=3, graphs=True)
    for _ in range(2):
        scheduler.enqueue(torch.arange(30))
    scheduler.enqueue(torch.arange(29))  # another size: padded from now on
    assert [b.size for b in scheduler._unstaged] == [30, 30, padded_size(29)]
    assert padded_size(29) == 32 and scheduler._unstaged[-1].ids.tolist() == list(range(29))


def test_an_error_under_graphs_is_the_error_without():
    """A batch too big for the cache, staged by a replayed graph: the same error at the same
    step, nothing lost, and training goes on as without graphs."""
    batches = batches_of([6] * 30, pooling=2, seed=2)
    for values, _ in batches:
        values.remainder_(5)  # 5 rows a table: two batches in flight fit in 16 slots
    batches[20][0][:] = torch.arange(batches[20][0].numel()) % 12  # 12 rows a table: 24 > 16
    config = dict(capacity=8, lookahead=3, prefetch_depth=1)
    plain, plain_outs, plain_errors = train(CacheConfig(**config), batches)
    graphed, graphed_outs, graphed_errors = train(CacheConfig(**config, cuda_graphs=True), batches)
    assert [t for t, _ in plain_errors] == [20] and plain_errors == graphed_errors
    assert "24 distinct rows but the cache holds 16" in plain_errors[0][1]
    assert graphed.engines[0].scheduler.graphs.replays > 20
    assert_same_training(plain, plain_outs, graphed, graphed_outs)


def test_sequence_rows_and_an_invalid_id_under_graphs_are_as_without():
    """`CachedEmbeddings` (per-id rows) through replayed graphs, routing included, and a batch
    of the same size with an invalid id in it: the same error at the same step (its check
    words come out of the routing's graph), then the same training."""
    batches = batches_of([6] * 40, pooling=2, seed=7)
    batches[25][0][3] = 300  # an id of t0, which has 300 rows
    config = dict(capacity=40, lookahead=4, prefetch_depth=1, learning_rate=1.0)
    runs = [
        train(CacheConfig(**config, cuda_graphs=g), batches, module=CachedEmbeddings)
        for g in (False, True)
    ]
    (plain, plain_outs, plain_errors), (graphed, graphed_outs, graphed_errors) = runs
    assert [t for t, _ in plain_errors] == [25] and plain_errors == graphed_errors
    assert "id 300" in plain_errors[0][1]
    assert_same_training(plain, plain_outs, graphed, graphed_outs)
    assert graphed._router.graphs.replays > 20 and graphed.engines[0].scheduler.graphs.replays > 20


def test_the_replayed_path_reads_nothing_back():
    batches = batches_of([6] * 40, pooling=2, seed=4)
    config = CacheConfig(capacity=40, lookahead=4, prefetch_depth=1, cuda_graphs=True)
    cached = CachedEmbeddingBags(TABLES, config)
    audit, enqueued = SyncAudit(), 0
    for t, batch in enumerate(batches):
        with audit if t >= 20 else _nothing():  # captured by then, and evicting
            while enqueued < len(batches) and enqueued <= t + config.lookahead:
                cached.enqueue(*batches[enqueued])
                enqueued += 1
            cached.prefetch()
            loss_of(cached(*batch)).backward()
    assert not audit.sites, audit.report()
    assert cached.engines[0].scheduler.graphs.replays > 20
    assert all(s.evictions > 0 for s in cached.stats().values())


class _nothing:  # noqa: N801
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_cpu_graph_replays_what_it_recorded():
    """As a CUDA graph: Python runs at capture only, a host value is baked in, in-place work
    and results are redone on the same tensors, reading the inputs' new values."""
    state, calls = torch.zeros(3), []

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        calls.append(len(calls))
        state.add_(x)
        return (x * 2 + len(calls),)

    x = torch.ones(3)
    graph = CPUGraph()
    (out,) = graph.capture(fn, x)
    assert torch.equal(out, torch.full((3,), 3.0)) and torch.equal(state, torch.ones(3))
    x.fill_(5.0)
    graph.replay()
    assert calls == [0]
    assert torch.equal(state, torch.full((3,), 6.0))
    assert torch.equal(out, torch.full((3,), 11.0))  # 5 * 2 + the 1 baked in at capture


def test_a_cpu_graph_refuses_a_read_back():
    with pytest.raises(DistcacheConfigError, match="cannot replay"):
        CPUGraph().capture(lambda x: (x * int(x.sum()),), torch.ones(2))


def test_the_graph_cache_runs_then_captures_then_replays():
    cache = GraphCache(torch.device("cpu"), enabled=True, limit=2)
    total = torch.zeros(())

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        total.add_(x.sum())
        return (x + total,)

    results = [cache.run("k", fn, torch.full((2,), float(i)))[0] for i in range(4)]
    assert (cache.captures, cache.replays) == (1, 2)
    # As run directly (total 0, 2, 6, 12), and fresh tensors, not the graph's overwritten output.
    assert [r.tolist() for r in results] == [[0, 0], [3, 3], [8, 8], [15, 15]]
    for key in ("a", "b", "c"):  # one more key than the limit: the oldest graph goes
        cache.run(key, fn, torch.ones(2))
        cache.run(key, fn, torch.ones(2))
    assert cache.captures == 4 and len(cache._entries) == 2
    assert GraphCache(torch.device("cpu"), enabled=False).run("k", fn, torch.ones(2))


def test_a_run_that_must_not_wait_replays_but_never_captures():
    """`capture=False` (a plan whose size the host could not read without waiting): a key
    never captured runs op by op, however often it comes; a captured one is replayed."""
    cache = GraphCache(torch.device("cpu"), enabled=True)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x * 2,)

    for _ in range(3):
        assert cache.run("new", fn, torch.ones(2), capture=False)[0].tolist() == [2, 2]
    assert (cache.captures, cache.replays) == (0, 0)
    for _ in range(2):
        cache.run("old", fn, torch.ones(2))
    assert cache.run("old", fn, torch.full((2,), 3.0), capture=False)[0].tolist() == [6, 6]
    assert (cache.captures, cache.replays) == (1, 1)


def test_the_graph_cache_stops_capturing_when_keys_keep_changing(caplog):
    """A capture synchronizes the device: keys that come in turn, more than the cache keeps,
    would capture again and again. After `limit` dropped graphs it captures no more (with a
    warning) and still replays what it holds."""

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x * 2,)

    cache = GraphCache(torch.device("cpu"), enabled=True, limit=2, name="test")
    for _ in range(6):
        for key in ("a", "b", "c"):  # three keys in turn, two kept
            assert torch.equal(cache.run(key, fn, torch.ones(2))[0], torch.full((2,), 2.0))
    assert cache.dropped == 2 and cache.captures == 4
    assert "capture no more" in caplog.text
    replays = cache.replays
    cache.run("c", fn, torch.ones(2))  # still held: replayed
    assert cache.replays == replays + 1
    cache.run("b", fn, torch.ones(2))  # dropped, and not captured again
    assert cache.captures == 4


def test_a_failed_cuda_capture_falls_back_to_running_op_by_op(monkeypatch, caplog):
    """A CUDA capture records without running, so when it fails nothing was done: the cache
    warns, runs the call directly, and every later one too (faked here: no GPU)."""
    from distcache.cache import graphs

    class Refused(graphs.CPUGraph):
        executes_at_capture = False

        def capture(self, fn, *inputs):  # noqa: ANN001, ANN002, ANN201
            raise RuntimeError("operation not permitted when stream is capturing")

    cache = GraphCache(torch.device("cpu"), enabled=True, name="test")
    monkeypatch.setattr(cache, "_graph_type", lambda: Refused)
    total = torch.zeros(())

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        total.add_(1)
        return (x + total,)

    results = [cache.run("k", fn, torch.zeros(1))[0].item() for _ in range(4)]
    assert results == [1.0, 2.0, 3.0, 4.0]  # each call ran once, none twice or not at all
    assert not cache.enabled and cache.captures == 0
    assert "capture failed" in caplog.text


def test_staging_defaults_to_direct_on_cuda_with_triton(monkeypatch):
    from distcache.cache import config as config_module

    default, cuda, cpu = CacheConfig(), torch.device("cuda"), torch.device("cpu")
    assert default.staging_on(cpu) == "worker"
    monkeypatch.setattr(config_module, "triton_installed", lambda: True)
    assert default.staging_on(cuda) == "direct"
    assert CacheConfig(staging="worker").staging_on(cuda) == "worker"
    assert CacheConfig(staging="direct").staging_on(cpu) == "direct"
    monkeypatch.setattr(config_module, "triton_installed", lambda: False)
    assert default.staging_on(cuda) == "worker"  # no kernel to skip the padding
    with pytest.raises(DistcacheConfigError, match="staging.*or None"):
        CacheConfig(staging="thread")


def test_cuda_graphs_is_a_bool_or_none_which_means_on_for_cuda():
    with pytest.raises(DistcacheConfigError, match="cuda_graphs.*True, False, or None"):
        CacheConfig(cuda_graphs="yes")
    default = CacheConfig()
    assert default.graphs_on(torch.device("cuda")) and not default.graphs_on(torch.device("cpu"))
    assert CacheConfig(cuda_graphs=True).graphs_on(torch.device("cpu"))
    assert not CacheConfig(cuda_graphs=False).graphs_on(torch.device("cuda"))
    bags = CachedEmbeddingBags(make_tables([4], [10]), CacheConfig(capacity=4))  # on the CPU
    assert not bags._router.graphs.enabled and not bags.engines[0].scheduler.graphs.enabled


def test_the_packed_buffer_round_trips_every_kind_of_tensor():
    """`_Layout` packs a call's tensors into one buffer per dtype and views them back: 1-D or
    not, non-contiguous, 0-dim, bytes, bools, one or several of a dtype, all come back equal;
    packed into given buffers, the same."""
    from distcache.cache.graphs import _Layout

    g = torch.Generator().manual_seed(3)
    tensors = (
        torch.randint(0, 9, (5,), generator=g),  # int64
        torch.randint(0, 9, (3, 4), generator=g, dtype=torch.int32).t(),  # 2-D, non-contiguous
        torch.tensor(7, dtype=torch.int32),  # 0-dim
        torch.randint(0, 255, (3,), generator=g, dtype=torch.uint8),
        torch.rand(5, generator=g) > 0.5,  # bool
        torch.rand(2, 3, generator=g, dtype=torch.float16),
        torch.randint(0, 9, (0,), generator=g),  # empty, int64 again
        torch.randint(0, 9, (4,), generator=g, dtype=torch.int32)[::2],  # 1-D, strided
    )
    layout = _Layout.of(tensors)
    packed = layout.pack(tensors)
    assert [b.dtype for b in packed] == list(layout.dtypes) and all(b.dim() == 1 for b in packed)
    into = tuple(torch.empty_like(b) for b in packed)
    for buffers in (packed, layout.pack(tensors, into=into)):
        back = layout.unpack(buffers)
        for t, b in zip(tensors, back, strict=True):
            assert b.dtype == t.dtype and b.shape == t.shape and torch.equal(b, t)
