"""Hot rows in the cost model and the solver: priced by hand, chosen where they pay, exported
as `CacheConfig.hot_rows`."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from distcache.errors import DistcacheConfigError
from distcache.planner.candidates import Problem
from distcache.planner.cost import global_terms, plan_cost
from distcache.planner.hot import choose_hot_rows
from distcache.planner.pricing import State
from distcache.planner.shards import shard_terms
from distcache.planner.solver import solve
from distcache.planner.stats import AccessProfile, expected_unique
from distcache.planner.topology import preset
from distcache.planner.torchrec.export import from_sharding_plan, hottest_rows, to_sharding_plan
from distcache.planner.types import (
    DATA_PARALLEL,
    HOST_CACHED,
    ROW_WISE,
    TABLE_ROW_WISE,
    TABLE_WISE,
    Placement,
    Plan,
    SolverOptions,
    TablePlan,
    TableStats,
    Topology,
    Workload,
)
from distcache.planner.workloads import workload_preset

TOPOLOGY = Topology(
    name="toy",
    world_size=2,
    ranks_per_node=1,
    device_memory_bytes=10**7,
    host_memory_bytes=10**8,
    device_memory_bw_bytes_per_s=1e11,
    host_to_device_bw_bytes_per_s=1e10,
    intra_node_bw_bytes_per_s=1e11,
    inter_node_bw_bytes_per_s=1e10,
    network_latency_s=2e-5,
    dense_flops_per_s=1e12,
)
TABLE = TableStats(name="a", rows=1000, dim=16, pooling_factor=2, alpha=1.2)
WORKLOAD = Workload(
    name="toy", tables=(TABLE,), batch_size_per_rank=100, bottom_mlp=(8, 16), top_mlp=(4, 1)
)
WHOLE = Placement(sharding=TABLE_WISE, shards=1)


def _plan(hot: int, **kwargs) -> Plan:
    table = TablePlan(table="a", sharding=TABLE_WISE, ranks=(0,), hot_rows=hot, **kwargs)
    return Plan(name=f"hot{hot}", tables=(table,))


def test_hot_rows_priced_by_hand() -> None:
    H, B, P, D, W = 10, 100, 2, 16, 2
    p = AccessProfile.power_law(TABLE.rows, TABLE.alpha).probabilities
    h = p[:H].sum()
    cold_unique = expected_unique(AccessProfile(p), B * P * W) - float(
        (-np.expm1(B * P * W * np.log1p(-p[:H]))).sum()
    )
    plain = shard_terms(TABLE, WORKLOAD, TOPOLOGY, WHOLE)
    hot = shard_terms(TABLE, WORKLOAD, TOPOLOGY, dataclasses.replace(WHOLE, hot_rows=H))
    assert hot.hot_fraction == pytest.approx(h, rel=1e-6)
    assert hot.ids_per_step == pytest.approx(B * P * W * (1 - h), rel=1e-6)
    assert hot.unique_rows_per_step == pytest.approx(cold_unique, rel=1e-3)
    assert hot.ids_bytes_per_peer == pytest.approx(B * P * (1 - h) * 8, rel=1e-6)
    # Table-wise: the bags whose P ids were all hot are not sent; row-wise reduces every bag.
    assert hot.embedding_bytes_per_peer == pytest.approx(
        plain.embedding_bytes_per_peer * (1 - h**P), rel=1e-9
    )
    row_wise = Placement(sharding=ROW_WISE, shards=2)
    assert (
        shard_terms(TABLE, WORKLOAD, TOPOLOGY, row_wise).embedding_bytes_per_peer
        == shard_terms(
            TABLE, WORKLOAD, TOPOLOGY, dataclasses.replace(row_wise, hot_rows=H)
        ).embedding_bytes_per_peer
    )
    assert hot.hot_reduce_bytes == H * (D + 1) * 4
    assert hot.hot_device_bytes == H * (2 * D * 4)  # sgd: rows and gradient, no state
    assert hot.lookup_s < plain.lookup_s
    # Every rank holds the replica; the all-reduces add its bytes and two latencies (the
    # replicas, their learning rates).
    with_hot, without = (
        plan_cost(_plan(H), WORKLOAD, TOPOLOGY),
        plan_cost(_plan(0), WORKLOAD, TOPOLOGY),
    )
    added = np.subtract(with_hot.device_memory_bytes, without.device_memory_bytes)
    assert list(added) == [H * 2 * D * 4] * W
    expected = global_terms(WORKLOAD, TOPOLOGY, 0.0, {TABLE_WISE}, 0.0, H * (D + 1) * 4, 1)
    assert with_hot.per_rank[1].all_reduce_s == pytest.approx(expected.all_reduce_s)
    assert with_hot.per_rank[1].all_reduce_s > without.per_rank[1].all_reduce_s
    assert with_hot.per_rank[1].input_all_to_all_s < without.per_rank[1].input_all_to_all_s


def test_touched_rows_all_gathered_priced_by_hand() -> None:
    """hot_reduce='touched': no all-reduce bytes; each rank all-gathers as many rows as the
    most any rank's B·P ids touch among the H (the expected number, plus its standard
    deviation times E[max of 2 standard normals] = 1/sqrt(pi)), D + 1 floats each, from the
    W - 1 others."""
    H, B, P, D, W = 300, 100, 2, 16, 2
    p = AccessProfile.power_law(TABLE.rows, TABLE.alpha).probabilities
    q = -np.expm1(B * P * np.log1p(-p[:H]))  # each hot row touched by a rank's B·P ids
    touched = float(q.sum())
    most = touched + math.sqrt(float((q * (1 - q)).sum())) / math.sqrt(math.pi)
    hot = shard_terms(
        TABLE, WORKLOAD, TOPOLOGY, dataclasses.replace(WHOLE, hot_rows=H, hot_reduce="touched")
    )
    assert hot.hot_reduce_bytes == 0.0
    assert hot.hot_gather_bytes == pytest.approx(most * (D + 1) * 4, rel=1e-3)
    assert touched < 0.6 * H  # this profile's batch touches fewer rows than the replica holds
    gathered, whole = (
        plan_cost(_plan(H, hot_reduce="touched"), WORKLOAD, TOPOLOGY),
        plan_cost(_plan(H), WORKLOAD, TOPOLOGY),
    )
    latency = TOPOLOGY.network_latency_s
    dense = global_terms(WORKLOAD, TOPOLOGY, 0.0, {TABLE_WISE}).all_reduce_s
    # The dense all-reduce, the learning rates' all-reduce, the sizes' all-reduce, and the
    # all-gather: (W - 1) · bytes over the NIC (one rank per node here) plus its latency.
    all_gather = (W - 1) * hot.hot_gather_bytes / TOPOLOGY.inter_node_bw_bytes_per_s + latency
    assert gathered.per_rank[0].all_reduce_s == pytest.approx(dense + 2 * latency + all_gather)
    # No [H, dim] gradient: H·D·4 bytes less device memory on every rank.
    saved = np.subtract(whole.device_memory_bytes, gathered.device_memory_bytes)
    assert list(saved) == [H * D * 4] * W
    # Everything else equal but the update: of the rows the global batch touched, not all H.
    assert gathered.per_rank[0].lookup_s < whole.per_rank[0].lookup_s
    same = dataclasses.replace(
        gathered, per_rank=whole.per_rank, device_memory_bytes=whole.device_memory_bytes
    )
    assert same == whole


def test_the_solver_all_gathers_touched_rows_where_that_is_cheaper() -> None:
    """A replica of 90 % of the lookups (9,168 rows a table) of which a rank's batch touches
    fewer than 2,048: the solver all-gathers the touched rows, cheaper than all-reducing them
    all. A replica of 50 % (14 rows, every one touched by every batch): all of it all-reduced,
    as many bytes and one collective fewer."""
    workload, topology = _routing_bound()
    large = solve(workload, topology, options=SolverOptions(hot_row_shares=(0.9,)))
    assert all(t.hot_rows > 2048 and t.hot_reduce == "touched" for t in large.tables), large
    assert all("touched rows all-gathered" in large.explanations[t.table] for t in large.tables)
    whole = dataclasses.replace(
        large, tables=tuple(dataclasses.replace(t, hot_reduce="all") for t in large.tables)
    )
    assert plan_cost(large, workload, topology).step_s < plan_cost(whole, workload, topology).step_s
    small = solve(workload, topology, options=SolverOptions(hot_row_shares=(0.5,)))
    assert all(0 < t.hot_rows < 100 and t.hot_reduce == "all" for t in small.tables), small


def test_a_replica_frees_cache_slots() -> None:
    """Hot rows take no cache slot: a cache of C rows loads as one of C + H did."""
    cached = dataclasses.replace(
        WHOLE, storage=HOST_CACHED, cache_fraction=0.05, lookahead=8, prefetch_depth=1
    )
    plain = shard_terms(TABLE, WORKLOAD, TOPOLOGY, cached)
    hot = shard_terms(TABLE, WORKLOAD, TOPOLOGY, dataclasses.replace(cached, hot_rows=20))
    bigger = shard_terms(
        TABLE, WORKLOAD, TOPOLOGY, dataclasses.replace(cached, cache_fraction=0.07)
    )
    assert hot.loads_per_step == pytest.approx(bigger.loads_per_step, rel=1e-6)
    assert hot.loads_per_step < plain.loads_per_step


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hot_rows": -1}, "hot_rows must be an int >= 0"),
        ({"hot_rows": 5, "sharding": DATA_PARALLEL, "ranks": (0, 1)}, "replicated whole"),
        ({"hot_rows": 5, "hot_reduce": "some"}, "hot_reduce 'some' is not one of"),
    ],
)
def test_bad_hot_rows_are_refused(kwargs, message) -> None:
    with pytest.raises(DistcacheConfigError, match=message):
        TablePlan(**{"table": "a", "sharding": TABLE_WISE, "ranks": (0,), **kwargs})


def test_more_hot_rows_than_the_table_has_is_refused() -> None:
    with pytest.raises(DistcacheConfigError, match="hot_rows 2000 exceeds its 1000 rows"):
        plan_cost(_plan(2000), WORKLOAD, TOPOLOGY)


def _routing_bound() -> tuple[Workload, Topology]:
    """Ids cost a lot to route and serve (a CPU's per-id framework cost), collectives little:
    replicating the hottest rows pays."""
    topology = dataclasses.replace(
        TOPOLOGY, device_memory_bytes=10**9, id_overhead_s=2e-6, sync_latency_s=1e-6
    )
    tables = tuple(
        TableStats(name=f"t{i}", rows=2_000_000, dim=16, pooling_factor=4, alpha=1.2)
        for i in range(3)
    )
    return dataclasses.replace(WORKLOAD, tables=tables, batch_size_per_rank=512), topology


def test_the_solver_replicates_hot_rows_where_they_pay() -> None:
    workload, topology = _routing_bound()
    plan = solve(workload, topology)
    without = solve(workload, topology, options=SolverOptions(hot_row_shares=()))
    assert any(t.hot_rows for t in plan.tables), plan
    assert not any(t.hot_rows for t in without.tables)
    ours = plan_cost(plan, workload, topology)
    assert ours.fits
    assert ours.step_s < plan_cost(without, workload, topology).step_s
    # The same placements without their replicas are slower: the replicas earn their keep.
    stripped = dataclasses.replace(
        plan, tables=tuple(dataclasses.replace(t, hot_rows=0) for t in plan.tables)
    )
    assert ours.step_s < plan_cost(stripped, workload, topology).step_s
    hot = next(t for t in plan.tables if t.hot_rows)
    assert f"{hot.hot_rows} hot rows replicated" in plan.explanations[hot.table]


def test_no_hot_rows_where_the_all_reduce_costs_more() -> None:
    """A collective's latency above what the routed ids cost: no replica."""
    workload, topology = _routing_bound()
    topology = dataclasses.replace(topology, id_overhead_s=0.0, sync_latency_s=1e-3)
    plan = solve(workload, topology)
    assert not any(t.hot_rows for t in plan.tables)
    assert "no hot rows; tried" in plan.explanations["t0"]


def test_the_hot_path_cost_is_per_bag_and_can_rule_replicas_out() -> None:
    """`Topology.hot_bag_overhead_s` (calibrated on CPU: the split, the replica's pooling and
    its addition into the output) is paid per bag of the table's batch, on every rank; where it
    exceeds what the replica saves, the solver keeps none (measured on 2 CPU ranks: a plan
    with replicas the model chose 0.89 x the same plan without, before this cost was priced)."""
    costly = dataclasses.replace(TOPOLOGY, hot_bag_overhead_s=1e-6)
    free, paid = (
        shard_terms(TABLE, WORKLOAD, t, dataclasses.replace(WHOLE, hot_rows=10))
        for t in (TOPOLOGY, costly)
    )
    bags = WORKLOAD.batch_size_per_rank  # TABLE has 2 ids a bag: paid per bag, not per id
    assert paid.hot_lookup_s == pytest.approx(free.hot_lookup_s + 1e-6 * bags)
    plain = shard_terms(TABLE, WORKLOAD, costly, WHOLE)
    assert plain.lookup_s == shard_terms(TABLE, WORKLOAD, TOPOLOGY, WHOLE).lookup_s
    workload, topology = _routing_bound()
    assert any(t.hot_rows for t in solve(workload, topology).tables)
    expensive = dataclasses.replace(topology, hot_bag_overhead_s=4 * topology.id_overhead_s)
    plan = solve(workload, expensive)
    assert not any(t.hot_rows for t in plan.tables), plan


def test_the_solver_state_prices_replicas_as_plan_cost_does() -> None:
    workload, topology = _routing_bound()
    state = State(Problem(workload, topology, SolverOptions()))
    plan = solve(workload, topology, options=SolverOptions(hot_row_shares=()))
    for index, tp in enumerate(plan.tables):
        mode = next(
            m for g in state.p.groups[index] for m in g.modes if m.placement == tp.placement
        )
        state.add(index, mode, tp.ranks)
    choose_hot_rows(state, (0.5, 0.9))
    chosen = state.plan("s", {})
    assert any(t.hot_rows for t in chosen.tables)
    assert state.score()[0] == pytest.approx(plan_cost(chosen, workload, topology).step_s, rel=1e-9)


def test_notes_are_made_for_the_noted_tables_only_and_choose_alike() -> None:
    """`choose_hot_rows(..., noted=...)`: the notes of the tables asked for (those the plan
    explains), the same replicas and state as with every note made."""
    workload, topology = _routing_bound()
    plan = solve(workload, topology, options=SolverOptions(hot_row_shares=()))
    out = []
    for noted in (None, {1}):
        state = State(Problem(workload, topology, SolverOptions()))
        for index, tp in enumerate(plan.tables):
            groups = state.p.groups[index]
            mode = next(m for g in groups for m in g.modes if m.placement == tp.placement)
            state.add(index, mode, tp.ranks)
        out.append((choose_hot_rows(state, (0.5, 0.9), noted), state.placed, state.flat))
    (every, placed, flat), (some, placed_some, flat_some) = out
    assert len(every) > 1 and some == {1: every[1]}
    assert placed == placed_some and np.array_equal(flat, flat_some)


def test_export_names_the_hottest_rows_and_reads_them_back() -> None:
    counts = np.zeros(1000, dtype=np.int64)
    counts[[7, 3, 500]] = [50, 40, 30]
    counted = dataclasses.replace(TABLE, counts=counts)
    assert hottest_rows(counted, 2) == [3, 7]
    assert hottest_rows(TABLE, 3) == [0, 1, 2]  # a power law's rows are in popularity order
    workload = dataclasses.replace(WORKLOAD, tables=(counted,))
    sharding = to_sharding_plan(_plan(3), workload, world_size=2)
    assert sharding.plan[""]["a"].cache_config.hot_rows == (3, 7, 500)
    custom = to_sharding_plan(
        _plan(2), workload, world_size=2, hot_row_ids=lambda t, n: [999 - r for r in range(n)]
    )
    assert custom.plan[""]["a"].cache_config.hot_rows == (998, 999)
    back = from_sharding_plan(sharding, workload, world_size=2)
    assert back.table("a").hot_rows == 3
    assert back.table("a").hot_reduce == "all"
    gathered = to_sharding_plan(_plan(3, hot_reduce="touched"), workload, world_size=2)
    assert gathered.plan[""]["a"].cache_config.hot_reduce == "touched"
    assert from_sharding_plan(gathered, workload, world_size=2).table("a").hot_reduce == "touched"


def test_the_framework_cost_is_per_bag_routed() -> None:
    """`Topology.id_overhead_s` is paid per bag (measured: the framework's cost follows bags,
    not ids), by the rank sending it and the shard serving it."""
    cost = dataclasses.replace(TOPOLOGY, id_overhead_s=1e-3)
    steps = {}
    for pooling in (1.0, 4.0):
        table = dataclasses.replace(TABLE, pooling_factor=pooling)
        workload = dataclasses.replace(WORKLOAD, tables=(table,))
        placed = TablePlan(table=table.name, sharding=TABLE_WISE, ranks=(0,))
        plan = Plan(name="p", tables=(placed,))
        steps[pooling] = (
            plan_cost(plan, workload, cost).per_rank[0].overhead_s
            - plan_cost(plan, workload, TOPOLOGY).per_rank[0].overhead_s,
            shard_terms(table, workload, cost, WHOLE).lookup_s
            - shard_terms(table, workload, TOPOLOGY, WHOLE).lookup_s,
        )
    bags_sent, bags_served = WORKLOAD.batch_size_per_rank, WORKLOAD.batch_size_per_rank * 2
    for pooling in (1.0, 4.0):
        sent, served = steps[pooling]
        assert sent == pytest.approx(1e-3 * bags_sent), pooling
        assert served == pytest.approx(1e-3 * bags_served), pooling


def test_sequence_tables_are_never_table_row_wise_and_their_replicas_run_on_our_kernel():
    """Criteo Terabyte's tables as sequence tables on 16 H100s: the solver offers them no
    table-row-wise layout (TorchRec's EmbeddingCollection has none), and a device-stored one
    with a replica is priced on distcache's kernel, as it runs (`to_sharding_plan`): a cache
    of every row, its store in host memory."""
    pooled = workload_preset("criteo-terabyte")
    sequence = dataclasses.replace(
        pooled, tables=tuple(dataclasses.replace(t, pooled=False) for t in pooled.tables)
    )
    topology = dataclasses.replace(preset("h100", world_size=16), device_memory_bytes=16 * 10**9)
    layouts = {
        group.modes[0].placement.sharding
        for groups in Problem(sequence, topology, SolverOptions()).groups
        for group in groups
    }
    assert TABLE_ROW_WISE not in layouts and ROW_WISE in layouts
    pooled_layouts = {
        g.modes[0].placement.sharding
        for gs in Problem(pooled, topology, SolverOptions()).groups
        for g in gs
    }
    assert TABLE_ROW_WISE in pooled_layouts
    table = sequence.tables[1]  # 39k rows
    replica = dataclasses.replace(WHOLE, hot_rows=100)
    plain = shard_terms(table, sequence, topology, WHOLE)
    hot = shard_terms(table, sequence, topology, replica)
    full = shard_terms(table, sequence, topology, dataclasses.replace(replica, storage=HOST_CACHED))
    assert plain.host_memory_bytes == 0
    assert hot.host_memory_bytes == full.host_memory_bytes == table.rows * hot.row_bytes
    assert hot.device_memory_bytes == full.device_memory_bytes > plain.device_memory_bytes
    pooled_hot = shard_terms(pooled.tables[1], pooled, topology, replica)
    assert pooled_hot.host_memory_bytes == 0  # a bag collection's replica: TorchRec's kernel


def test_tables_priced_in_speculative_chunks_choose_as_one_at_a_time(monkeypatch):
    """`choose_hot_rows` prices a chunk of tables against the state at once and prices the
    rest again after the first that moves: the replicas, the notes and the state come out
    exactly as when each table is priced alone (a chunk of one), on a plan where tables move
    (300 tables on 128 ranks: some take a replica of their own)."""
    from distcache.planner import hot
    from distcache.planner.search import improve, starts
    from distcache.planner.solver import _baselines

    workload = workload_preset("synthetic:tables=300")
    topology = preset("h100", world_size=128, device_memory_bytes="16GB")
    options = SolverOptions()
    problem = Problem(workload, topology, options)
    states = starts(problem, seeds=_baselines(workload, topology, options))
    placed = improve(states, max_moves=options.max_moves, time_limit_s=600.0).placed

    def state() -> State:  # the same placed tables, added in the same order: the same floats
        s = State(problem)
        for index, (mode, ranks) in enumerate(placed):
            s.add(index, mode, ranks)
        return s

    moves = []
    choose = hot._choose_one
    monkeypatch.setattr(hot, "_choose_one", lambda *a: _counted(choose, moves, *a))
    out = {}
    for chunk in (1, hot.CHUNK):
        monkeypatch.setattr(hot, "CHUNK", chunk)
        s = state()
        notes = choose_hot_rows(s, options.hot_row_shares)
        out[chunk] = (notes, s.placed, s.flat.copy(), s.score())
    alone, chunked = out[1], out[hot.CHUNK]
    assert any(moves) and hot.CHUNK > 1
    assert alone[0] == chunked[0] and alone[1] == chunked[1] and alone[3] == chunked[3]
    assert np.array_equal(alone[2], chunked[2])


def _counted(choose, moves: list, *args):  # noqa: ANN001
    tried, moved = choose(*args)
    moves.append(moved)
    return tried, moved
