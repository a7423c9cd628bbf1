"""A rank's cached tables of one width share one cache in `plan_cost`, as the engine runs them:
against the frequency model on exact per-row probabilities, and against the engine itself
replaying a power-law trace (`cache.simulate`)."""

import math

import numpy as np
import pytest
import torch

from distcache.cache.simulate import simulate
from distcache.data.traces import zipf_trace
from distcache.planner.candidates import Problem
from distcache.planner.cost import plan_cost
from distcache.planner.pricing import State, evaluate
from distcache.planner.rates import scheduling_time_s
from distcache.planner.shards import table_plan_terms
from distcache.planner.stats import AccessProfile, expected_loads
from distcache.planner.types import (
    HOST_CACHED,
    ROW_WISE,
    TABLE_WISE,
    Plan,
    SolverOptions,
    TablePlan,
    TableStats,
    Topology,
    Workload,
)

BATCH = 256
TOPOLOGY = Topology(
    name="two",
    world_size=2,
    ranks_per_node=2,
    device_memory_bytes=10**10,
    host_memory_bytes=10**11,
    device_memory_bw_bytes_per_s=1e12,
    host_to_device_bw_bytes_per_s=2e10,
    host_to_device_latency_s=1e-5,
    intra_node_bw_bytes_per_s=1e11,
    inter_node_bw_bytes_per_s=1e10,
    dense_flops_per_s=1e13,
)
WORKLOAD = Workload(
    name="four",
    tables=(
        TableStats(name="a", rows=200_000, dim=16, alpha=0.9),
        TableStats(name="b", rows=5_000, dim=16, alpha=1.1, pooling_factor=8),
        TableStats(name="c", rows=100_000, dim=32, alpha=1.0, pooling_factor=2),
        TableStats(name="d", rows=80_000, dim=16, alpha=0.9),
    ),
    batch_size_per_rank=BATCH,
)
TABLES = {t.name: t for t in WORKLOAD.tables}


def _cached(name, ranks, *, sharding=TABLE_WISE, fraction=0.05, lookahead=8, hot_rows=0):
    return TablePlan(
        table=name,
        sharding=sharding,
        ranks=ranks,
        storage=HOST_CACHED,
        cache_fraction=fraction,
        lookahead=lookahead,
        prefetch_depth=min(1, lookahead),
        hot_rows=hot_rows,
    )


def _cost(*tables, topology=TOPOLOGY):
    """`plan_cost` of a plan of `tables` (`TablePlan`s) of the workload of their tables."""
    workload = Workload(
        name="some", tables=tuple(TABLES[t.table] for t in tables), batch_size_per_rank=BATCH
    )
    return plan_cost(Plan(name="p", tables=tables), workload, topology)


def _touch(name, rows_split=1, hot_rows=0):
    """(q, weight) per row reaching a cache of one shard of table `name`: the chance a step's
    lookups touch it, and the share of the table's row the shard holds."""
    t = TABLES[name]
    p = AccessProfile.power_law(t.rows, t.alpha).probabilities[hot_rows:]
    lookups = BATCH * TOPOLOGY.world_size * t.pooling_factor
    return -np.expm1(lookups * np.log1p(-p)), np.full(p.size, 1 / rows_split)


def _frequency_loads(parts, capacity):
    """Rows loaded per step into a cache of `capacity` rows whose likeliest rows, of all
    `parts` (`_touch`) together, stay resident: every other touched row."""
    q, weight = (np.concatenate(x) for x in zip(*parts, strict=True))
    order = np.argsort(-q, kind="stable")
    q, weight = q[order], weight[order]
    outside = np.clip(np.cumsum(weight) - capacity, 0.0, weight)
    return float(outside @ q)


def _slots(name, fraction=0.05, rows_split=1):
    return math.ceil(fraction * math.ceil(TABLES[name].rows / rows_split))


def test_tables_of_one_width_on_a_rank_share_one_cache():
    """a and b (dim 16) on rank 0 share one cache of their slots together; c (dim 32) on rank
    0 and d (dim 16) on rank 1 have their own. The staging of rank 0 is its two caches'
    traffic (a load and a write-back per row) and one transfer each way per cache."""
    cost = _cost(_cached("a", (0,)), _cached("b", (0,)), _cached("c", (0,)), _cached("d", (1,)))
    shared = _frequency_loads([_touch("a"), _touch("b")], _slots("a") + _slots("b"))
    steps = BATCH * TOPOLOGY.world_size
    alone = {
        n: expected_loads(
            AccessProfile.power_law(TABLES[n].rows, TABLES[n].alpha),
            steps * TABLES[n].pooling_factor,
            _slots(n),
        )
        for n in "abcd"
    }
    assert shared < 0.9 * (alone["a"] + alone["b"])  # the sharing matters here
    assert cost.loads_per_step == pytest.approx([shared + alone["c"], alone["d"]], rel=3e-3)
    row_bytes = {n: WORKLOAD.row_bytes(TABLES[n]) for n in "abcd"}
    bw, latency = TOPOLOGY.host_to_device_bw_bytes_per_s, TOPOLOGY.host_to_device_latency_s
    staging = (2 * shared * row_bytes["a"] + 2 * alone["c"] * row_bytes["c"]) / bw + 4 * latency
    assert cost.per_rank[0].staging_s == pytest.approx(staging, rel=3e-3)


@pytest.mark.parametrize(
    "other",
    [
        _cached("b", (0,), lookahead=16),  # another look-ahead: another kernel
        _cached("b", (0,), lookahead=0),  # a reactive cache: another kernel
        _cached("b", (0, 1), sharding=ROW_WISE),  # another sharding type: another lookup
    ],
)
def test_caches_of_other_kernels_are_not_shared(other):
    """Tables whose `CacheConfig` (but for the capacity) or sharding type differ run on
    different kernels, each with its own cache, whatever their width: each loads what a cache
    of its own loads."""
    alone, only_b, both = _cost(_cached("a", (0,))), _cost(other), _cost(_cached("a", (0,)), other)
    want = np.add(alone.loads_per_step, only_b.loads_per_step)
    assert both.loads_per_step == pytest.approx(want, rel=1e-12)
    assert [c.staging_s for c in both.per_rank] == pytest.approx(
        [x.staging_s + y.staging_s for x, y in zip(alone.per_rank, only_b.per_rank, strict=True)],
        rel=1e-12,
    )


def test_tables_of_other_capacities_share_one_cache_of_their_slots_together():
    """a at 5 % and d cached whole (as the training job caches a table its cache could not
    hold) share one cache of both their slots, as one kernel runs them
    (`CACHE_CAPACITY_KEY`): d's coldest rows make room for a's likelier ones."""
    whole = _cached("d", (0,), fraction=1.0)
    shared = _frequency_loads([_touch("a"), _touch("d")], _slots("a") + TABLES["d"].rows)
    got = _cost(_cached("a", (0,)), whole).loads_per_step[0]
    assert got == pytest.approx(shared, rel=3e-3)
    assert got < 0.9 * _cost(_cached("a", (0,))).loads_per_step[0]  # apart: d loads none


def test_row_wise_shards_with_hot_rows_share_their_ranks_caches():
    """a and b, row-wise over both ranks, a with its 500 likeliest rows replicated: each
    rank's cache of their width holds half of each table's rows (a's but the replicated) in
    their two shards' slots; d, table-wise on rank 1, is another lookup, with a cache of its
    own."""
    a = _cached("a", (0, 1), sharding=ROW_WISE, hot_rows=500)
    b = _cached("b", (0, 1), sharding=ROW_WISE)
    shards = [_touch("a", rows_split=2, hot_rows=500), _touch("b", rows_split=2)]
    shared = _frequency_loads(shards, _slots("a", rows_split=2) + _slots("b", rows_split=2))
    d = _cost(_cached("d", (1,))).loads_per_step[1]
    got = _cost(a, b, _cached("d", (1,))).loads_per_step
    assert got == pytest.approx([shared, shared + d], rel=3e-3)


# (policy the engine runs, plan's look-ahead, how far the model may be from the engine): Che's
# approximation is close to LRU; the frequency model sees no batch ahead and counts no loads
# LFU pays to learn the counts (`stats.py`).
ENGINE = [("lru", 0, 0.03), ("lfu", 8, 0.1), ("lookahead", 8, 0.2)]


@pytest.mark.parametrize(("policy", "lookahead", "tolerance"), ENGINE)
def test_the_shared_model_follows_the_engine_on_a_power_law_trace(policy, lookahead, tolerance):
    """Two tables of one width on one rank, one small and hot, one large and cool: the engine
    (one `CacheEngine` over both tables' rows, their slots together) replaying a power-law
    trace loads what `plan_cost` says within `tolerance` in steady state, while one cache per
    table would be priced over 30 % higher."""
    tables = (
        TableStats(name="hot", rows=4_000, dim=16, alpha=1.1, pooling_factor=10),
        TableStats(name="cool", rows=40_000, dim=16, alpha=0.8, pooling_factor=3),
    )
    workload = Workload(name="two", tables=tables, batch_size_per_rank=100)
    one = Topology(**{**TOPOLOGY.to_dict(), "name": "one", "world_size": 1, "ranks_per_node": 1})
    plans = [_cached(t.name, (0,), lookahead=lookahead) for t in tables]
    modelled = plan_cost(Plan(name="p", tables=tuple(plans)), workload, one).loads_per_step[0]
    separate = sum(
        plan_cost(Plan(name=tp.table, tables=(tp,)), _only(workload, t), one).loads_per_step[0]
        for tp, t in zip(plans, tables, strict=True)
    )

    batches, warmup = 300, 100
    traces = [
        zipf_trace(rows=t.rows, alpha=t.alpha, batch=int(100 * t.pooling_factor),
                   batches=batches, seed=i)
        for i, t in enumerate(tables)
    ]  # fmt: skip
    offsets = [0, tables[0].rows]  # the engine's rows: the tables' rows one after the other
    trace = [
        torch.cat(
            [
                t.ids[t.offsets[b] : t.offsets[b + 1]] + o
                for t, o in zip(traces, offsets, strict=True)
            ]
        )
        for b in range(batches)
    ]
    slots = sum(_slots_of(t) for t in tables)
    run = {"num_rows": sum(t.rows for t in tables), "capacity": slots, "policy": policy}
    engine = simulate(trace, **run).loads - simulate(trace[:warmup], **run).loads
    engine /= batches - warmup
    assert modelled == pytest.approx(engine, rel=tolerance)
    assert separate > 1.3 * engine


def _only(workload, table):
    return Workload(name=table.name, tables=(table,), batch_size_per_rank=100)


def _slots_of(table):
    return math.ceil(0.05 * table.rows)


@pytest.mark.parametrize("device", ["cuda", "cpu"])  # staging behind compute, or exposed
def test_the_solvers_separate_caches_bound_the_shared_ones(device):
    """The solver prices each table's cache on its own (`pricing.evaluate`, `State`): for
    look-ahead caches that loads at least what the shared cache loads, so its staging and
    step are upper bounds of `plan_cost`'s."""
    topology = Topology(**{**TOPOLOGY.to_dict(), "compute_device": device})
    tables = tuple(
        TableStats(name=f"t{i}", rows=20_000 * (i + 1), dim=16, alpha=0.8 + 0.05 * i)
        for i in range(8)
    )
    workload = Workload(name="eight", tables=tables, batch_size_per_rank=BATCH)
    options = SolverOptions(
        shardings=(TABLE_WISE, ROW_WISE), storages=(HOST_CACHED,), cache_fractions=(0.1,)
    )
    state = State(Problem(workload, topology, options))
    for index in range(len(workload.tables)):
        candidates = [c for c in evaluate(state, index) if c.fits]
        pick = candidates[(5 * index) % len(candidates)]
        state.add(index, pick.mode, pick.ranks)
    cost = plan_cost(state.plan("cached", {}), workload, topology)
    shared = [c.total_s for c in cost.per_rank]
    assert all(s <= t * (1 + 1e-12) for s, t in zip(shared, state.totals(), strict=True))
    staged = state.load.overlapped_staging_s + state.load.exposed_staging_s
    assert all(c.staging_s < 0.9 * t for c, t in zip(cost.per_rank, staged, strict=True))
    if device == "cpu":
        assert cost.step_s < 0.99 * max(state.totals())


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_shared_caches_scheduler_is_priced_once_and_on_a_gpu_as_the_devices_work(device):
    """a and b (dim 16) on rank 0 share one cache, so one scheduler pass a step: their ids
    together, the shared cache's candidates (`scheduling_time_s`). On a GPU its time is the
    device's, in the rank's lookups, never hidden behind the step as the copies are; on CPU
    it is part of the staging, exposed. Either way the step grows by it once."""
    plain = Topology(**{**TOPOLOGY.to_dict(), "compute_device": device})
    calibrated = Topology(
        **{**plain.to_dict(), "schedule_s_per_id": 5e-8, "schedule_s_per_candidate": 8e-8}
    )
    tables = (_cached("a", (0,)), _cached("b", (0,)))
    workload = Workload(name="ab", tables=(TABLES["a"], TABLES["b"]), batch_size_per_rank=BATCH)
    terms = [table_plan_terms(tp, TABLES[tp.table], workload, calibrated) for tp in tables]
    expected = scheduling_time_s(
        calibrated,
        cache_rows=_slots("a") + _slots("b"),
        ids=sum(t.ids_per_step for t in terms),
        unique_rows=sum(t.unique_rows_per_step for t in terms),
        prefetch_depth=1,
    )
    assert expected < sum(t.scheduling_s for t in terms)  # one pass, not one per table
    (priced, _), (unpriced, _) = (
        _cost(*tables, topology=calibrated).per_rank,
        _cost(*tables, topology=plain).per_rank,
    )
    assert priced.total_s - unpriced.total_s == pytest.approx(expected)
    on, off = ("lookup_s", "staging_s") if device == "cuda" else ("staging_s", "lookup_s")
    assert getattr(priced, on) - getattr(unpriced, on) == pytest.approx(expected)
    assert getattr(priced, off) == pytest.approx(getattr(unpriced, off))
    if device == "cuda":  # the copies overlap the step: none of the staging is exposed
        assert priced.exposed_staging_s == 0 < priced.staging_s


def test_a_shared_reactive_cache_calibrated_on_a_gpu_has_its_copies_in_its_lookups():
    """a and b (dim 16) on rank 0 share one LRU cache: on a GPU whose topology measured FBGEMM's
    UVM cache (`reactive_cache_s_per_id`), its ids at that figure are its work, copies
    included, so the shared cache has no staging term; its loads are the same."""
    gpu = Topology(**{**TOPOLOGY.to_dict(), "compute_device": "cuda"})
    calibrated = Topology(**{**gpu.to_dict(), "reactive_cache_s_per_id": 1e-8})
    tables = (_cached("a", (0,), lookahead=0), _cached("b", (0,), lookahead=0))
    (plain, _), (priced, _) = (
        _cost(*tables, topology=gpu).per_rank,
        _cost(*tables, topology=calibrated).per_rank,
    )
    ids = BATCH * TOPOLOGY.world_size * (TABLES["a"].pooling_factor + TABLES["b"].pooling_factor)
    assert plain.staging_s > 0 and priced.staging_s == 0
    assert priced.lookup_s == pytest.approx(plain.lookup_s + ids * 1e-8)
    loads = [_cost(*tables, topology=t).loads_per_step for t in (gpu, calibrated)]
    assert loads[0] == loads[1] and sum(loads[0]) > 0


def test_a_shared_reactive_caches_misses_are_priced_once_on_its_shared_loads():
    """a and b share one LRU cache on a GPU calibrated per miss: its misses' work is priced
    once, on the shared cache's loads (not the sum of each table's in a cache of its own)."""
    per_id = Topology(
        **{**TOPOLOGY.to_dict(), "compute_device": "cuda", "reactive_cache_s_per_id": 1e-8}
    )
    both = Topology(**{**per_id.to_dict(), "reactive_cache_s_per_miss": 4e-7})
    tables = (_cached("a", (0,), lookahead=0), _cached("b", (0,), lookahead=0))
    (plain, _), (priced, _) = (_cost(*tables, topology=t).per_rank for t in (per_id, both))
    shared = sum(_cost(*tables, topology=both).loads_per_step)
    workload = Workload(name="ab", tables=(TABLES["a"], TABLES["b"]), batch_size_per_rank=BATCH)
    separate = sum(
        table_plan_terms(tp, TABLES[tp.table], workload, both).loads_per_step for tp in tables
    )
    assert shared != pytest.approx(separate)
    assert priced.lookup_s - plain.lookup_s == pytest.approx(shared * 4e-7)
