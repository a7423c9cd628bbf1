"""The cost model against hand computation, the exact statistics, and monotonicity."""

import dataclasses
import math
import re

import numpy as np
import pytest

from distcache.cache.capacity import CACHE_ROW_INDEX_BYTES_LOOKAHEAD, CACHE_SLOT_BYTES
from distcache.errors import DistcacheConfigError
from distcache.planner.cost import SharedTerms, all_to_all_sent_bytes, global_terms, plan_cost
from distcache.planner.dense import dense_flops_per_sample, dense_parameter_bytes
from distcache.planner.rates import (
    DENSE_UPDATE_PASSES,
    SCHEDULER_MIN_SCAN,
    scheduled_candidates,
    staging_time_s,
)
from distcache.planner.shards import ShardTerms, shard_access, shard_terms
from distcache.planner.stats import AccessProfile, expected_loads, expected_unique
from distcache.planner.types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    HOST_CACHED,
    ROW_WISE,
    TABLE_ROW_WISE,
    TABLE_WISE,
    Placement,
    Plan,
    TablePlan,
    TableStats,
    Topology,
    Workload,
)

LATENCY = 2e-5
TOPOLOGY = Topology(
    name="toy",
    world_size=2,
    ranks_per_node=1,  # two nodes: every byte between ranks crosses the NIC
    device_memory_bytes=10**6,
    host_memory_bytes=10**7,
    device_memory_bw_bytes_per_s=1e11,
    host_to_device_bw_bytes_per_s=1e10,
    host_to_device_latency_s=1e-5,
    intra_node_bw_bytes_per_s=1e11,
    inter_node_bw_bytes_per_s=1e10,
    network_latency_s=LATENCY,
    dense_flops_per_s=1e12,
)
WORKLOAD = Workload(
    name="toy",
    tables=(
        TableStats(name="a", rows=1000, dim=16, pooling_factor=2, alpha=1.0),
        TableStats(name="b", rows=500, dim=8, pooling_factor=1, alpha=1.2),
    ),
    batch_size_per_rank=100,
    bottom_mlp=(8, 4),
    top_mlp=(4, 1),
)
PLAN = Plan(
    name="toy",
    tables=(
        TablePlan(table="a", sharding=TABLE_WISE, ranks=(0,)),
        TablePlan(
            table="b",
            sharding=TABLE_WISE,
            ranks=(1,),
            storage=HOST_CACHED,
            cache_fraction=0.5,
            lookahead=2,
            prefetch_depth=1,
        ),
    ),
)


def test_dense_terms_by_hand():
    # bottom 13->8->4, dot interaction of 3 vectors of 4, top (4 + 3)->4->1
    assert dense_flops_per_sample(WORKLOAD) == 2 * (13 * 8 + 8 * 4) + 2 * 9 * 4 + 2 * (7 * 4 + 4)
    assert dense_parameter_bytes(WORKLOAD) == 4 * ((13 * 8 + 8) + (8 * 4 + 4) + (7 * 4 + 4) + 5)


def test_two_tables_on_two_ranks_by_hand():
    cost = plan_cost(PLAN, WORKLOAD, TOPOLOGY)
    dense = 3 * dense_flops_per_sample(WORKLOAD) * 100 / 1e12
    profile_a, profile_b = AccessProfile.power_law(1000, 1.0), AccessProfile.power_law(500, 1.2)
    unique_a, unique_b = expected_unique(profile_a, 400), expected_unique(profile_b, 200)
    lookup_a = (2 * 400 * 64 + 2 * unique_a * 64) / 1e11  # 16 floats = 64 B = 2 sectors
    lookup_b = (2 * 200 * 32 + 2 * unique_b * 32) / 1e11
    loads_b = expected_loads(profile_b, 200, 250, "frequency")
    staging_b = 2 * loads_b * 32 / 1e10 + 2 * 1e-5
    # a's ids dominate both directions; one sharding type: 3 input and 2 output collectives
    ids = max(100 * 2 * 8, 100 * 1 * 8) / 1e10 + 3 * LATENCY
    emb = 2 * (max(100 * 16 * 4, 100 * 8 * 4) / 1e10 + LATENCY)
    all_reduce = dense_parameter_bytes(WORKLOAD) / 1e10 + LATENCY  # 2 nodes of one rank
    r0, r1 = cost.per_rank
    assert r0.lookup_s == pytest.approx(lookup_a)
    assert r1.lookup_s == pytest.approx(lookup_b)
    assert (r0.staging_s, r1.staging_s) == (0.0, pytest.approx(staging_b))
    assert r1.exposed_staging_s == pytest.approx(max(0.0, staging_b - dense - lookup_b))
    for rank in (r0, r1):
        assert rank.dense_compute_s == pytest.approx(dense)
        assert rank.input_all_to_all_s == pytest.approx(ids)
        assert rank.output_all_to_all_s == pytest.approx(emb)
        assert rank.all_reduce_s == pytest.approx(all_reduce)
    cache_device = 250 * (32 + CACHE_SLOT_BYTES) + 500 * CACHE_ROW_INDEX_BYTES_LOOKAHEAD
    assert cost.device_memory_bytes == (1000 * 64, cache_device)
    assert cost.host_memory_bytes == (0, 500 * 32)
    assert cost.fits and cost.violations == ()
    assert cost.global_batch_size == 200
    assert cost.step_s == max(r0.total_s, r1.total_s)


def test_reactive_cache_is_priced_with_lru_on_the_critical_path():
    """A TorchRec UVM-cached table: host_cached with lookahead 0."""
    reactive = dataclasses.replace(PLAN.tables[1], lookahead=0, prefetch_depth=0)
    plan = dataclasses.replace(PLAN, tables=(PLAN.tables[0], reactive))
    cost = plan_cost(plan, WORKLOAD, TOPOLOGY)
    loads = expected_loads(AccessProfile.power_law(500, 1.2), 200, 250, "lru")
    staging = 2 * loads * 32 / 1e10 + 2 * 1e-5
    assert cost.per_rank[1].staging_s == pytest.approx(staging)
    assert cost.per_rank[1].exposed_staging_s == pytest.approx(staging)
    assert cost.step_s > plan_cost(PLAN, WORKLOAD, TOPOLOGY).step_s


def _terms(table, topology=TOPOLOGY, **kwargs):
    return shard_terms(
        table, WORKLOAD, topology, Placement(sharding=TABLE_WISE, shards=1, **kwargs)
    )


def test_bigger_caches_stage_less():
    table = TableStats(name="big", rows=200_000, dim=16, alpha=1.05)
    staged = [
        _terms(
            table, storage=HOST_CACHED, cache_fraction=f, lookahead=8, prefetch_depth=1
        ).staging_bytes_per_step
        for f in (0.001, 0.01, 0.05, 0.2, 0.5, 1.0)
    ]
    assert all(a > b for a, b in zip(staged, staged[1:-1], strict=False))
    assert staged[-1] == 0.0
    device = [
        _terms(table, storage=HOST_CACHED, cache_fraction=f, lookahead=8).device_memory_bytes
        for f in (0.01, 0.1, 0.5)
    ]
    assert device == sorted(device)


def test_more_bandwidth_is_never_slower():
    table = TableStats(name="big", rows=200_000, dim=16, alpha=1.05)
    cached = {"storage": HOST_CACHED, "cache_fraction": 0.05, "lookahead": 8, "prefetch_depth": 1}
    slow, fast = TOPOLOGY, dataclasses.replace(TOPOLOGY, host_to_device_bw_bytes_per_s=1e11)
    assert _terms(table, fast, **cached).staging_s < _terms(table, slow, **cached).staging_s
    quick = dataclasses.replace(TOPOLOGY, device_memory_bw_bytes_per_s=1e12)
    assert _terms(table, quick).lookup_s < _terms(table, slow).lookup_s
    previous = math.inf
    for inter in (1e9, 1e10, 1e11):
        step = plan_cost(
            PLAN, WORKLOAD, dataclasses.replace(TOPOLOGY, inter_node_bw_bytes_per_s=inter)
        ).step_s
        assert step < previous
        previous = step


def test_write_backs_move_at_the_device_to_host_rate():
    """Half of a cache's staging bytes are write-backs: at `device_to_host_bw_bytes_per_s`
    where the topology has it, else at the host-to-device rate."""
    both = dataclasses.replace(TOPOLOGY, host_to_device_bw_bytes_per_s=2e9)
    apart = dataclasses.replace(both, device_to_host_bw_bytes_per_s=1e9)
    latencies = 2 * TOPOLOGY.host_to_device_latency_s
    assert staging_time_s(4e6, both) == pytest.approx(4e6 / 2e9 + latencies)
    assert staging_time_s(4e6, apart) == pytest.approx(2e6 / 2e9 + 2e6 / 1e9 + latencies)
    assert staging_time_s(0.0, apart) == 0.0


def test_sharding_semantics():
    table = WORKLOAD.tables[0]
    tw = _terms(table)
    rw = shard_terms(table, WORKLOAD, TOPOLOGY, Placement(sharding=ROW_WISE, shards=2))
    cw = shard_terms(table, WORKLOAD, TOPOLOGY, Placement(sharding=COLUMN_WISE, shards=2))
    dp = shard_terms(table, WORKLOAD, TOPOLOGY, Placement(sharding=DATA_PARALLEL, shards=2))
    assert (rw.shard_rows, rw.ids_per_step) == (500, tw.ids_per_step / 2)
    assert rw.unique_rows_per_step == pytest.approx(tw.unique_rows_per_step / 2)
    assert rw.embedding_bytes_per_peer == tw.embedding_bytes_per_peer  # partial sums, full dim
    assert rw.ids_bytes_per_peer == tw.ids_bytes_per_peer / 2
    assert (cw.shard_dim, cw.ids_bytes_per_peer) == (8, tw.ids_bytes_per_peer)
    assert cw.embedding_bytes_per_peer == tw.embedding_bytes_per_peer / 2
    assert (dp.ids_bytes_per_peer, dp.embedding_bytes_per_peer) == (0.0, 0.0)
    assert dp.all_reduce_bytes == 1000 * 16 * 4


def test_row_wise_outputs_at_their_calibrated_rate_by_hand():
    """Each byte of a row-wise output (TorchRec's reduce-scatter and all-gather) priced as
    `row_wise_output_slowdown` all-to-all bytes, with `row_wise_output_latency_s` a step; the
    bytes sent stay the bytes; other shardings' outputs are untouched."""
    row_wise = Plan(
        name="rw",
        tables=(
            TablePlan(table="a", sharding=ROW_WISE, ranks=(0, 1)),
            TablePlan(table="b", sharding=TABLE_WISE, ranks=(1,)),
        ),
    )
    slow = dataclasses.replace(
        TOPOLOGY, row_wise_output_slowdown=4.0, row_wise_output_latency_s=3e-4
    )
    plain, priced = plan_cost(row_wise, WORKLOAD, TOPOLOGY), plan_cost(row_wise, WORKLOAD, slow)
    # Each rank sends the other its partial sums of a (B·D·4 = 100·16·4 bytes) over the NIC
    # (two nodes), forward and backward; rank 1 also sends b's outputs (100·8·4) to rank 0:
    # each rank's busier direction carries both, as priced bytes a·4 + b.
    a, b = 100 * 16 * 4, 100 * 8 * 4
    for rank, (was, now) in enumerate(zip(plain.per_rank, priced.per_rank, strict=True)):
        assert now.output_all_to_all_s - was.output_all_to_all_s == pytest.approx(
            2 * (4 * a + b) / 1e10 - 2 * (a + b) / 1e10 + 3e-4
        ), rank
    wire = all_to_all_sent_bytes(row_wise, WORKLOAD, slow)
    assert wire.tolist() == all_to_all_sent_bytes(row_wise, WORKLOAD, TOPOLOGY).tolist()
    assert plan_cost(PLAN, WORKLOAD, slow).step_s == plan_cost(PLAN, WORKLOAD, TOPOLOGY).step_s


def test_violations():
    too_big = Plan(
        name="big",
        tables=(
            TablePlan(table="a", sharding=DATA_PARALLEL, ranks=(0, 1)),
            TablePlan(table="b", sharding=TABLE_WISE, ranks=(1,)),
        ),
    )
    small = dataclasses.replace(TOPOLOGY, device_memory_bytes=50_000)
    cost = plan_cost(too_big, WORKLOAD, small)
    assert not cost.fits
    assert any("rank 1: device memory" in v for v in cost.violations)
    tiny_cache = dataclasses.replace(PLAN.tables[1], cache_fraction=0.01)
    cost = plan_cost(
        dataclasses.replace(PLAN, tables=(PLAN.tables[0], tiny_cache)), WORKLOAD, TOPOLOGY
    )
    assert not cost.fits
    (said,) = [v for v in cost.violations if "table 'b'" in v]
    # It names the rows that would do: a cache of exactly those fits, one row fewer does not.
    need = int(re.search(r"smaller than the (\d+) rows its 2 batches in flight", said)[1])
    rows = next(t.rows for t in WORKLOAD.tables if t.name == "b")
    for fraction, fits in ((need / rows, True), ((need - 1) / rows, False)):
        sized = dataclasses.replace(tiny_cache, cache_fraction=fraction)
        plan = dataclasses.replace(PLAN, tables=(PLAN.tables[0], sized))
        assert plan_cost(plan, WORKLOAD, TOPOLOGY).fits is fits


@pytest.mark.parametrize(
    "tables, message",
    [
        ((TablePlan(table="a", sharding=TABLE_WISE, ranks=(0,)),), "unplanned"),
        (PLAN.tables + (TablePlan(table="a", sharding=TABLE_WISE, ranks=(1,)),), "twice"),
        (PLAN.tables + (TablePlan(table="c", sharding=TABLE_WISE, ranks=(1,)),), "unknown"),
        ((PLAN.tables[0], TablePlan(table="b", sharding=TABLE_WISE, ranks=(2,))), "outside"),
        ((PLAN.tables[0], TablePlan(table="b", sharding=ROW_WISE, ranks=(1, 1))), "repeat"),
        ((PLAN.tables[0], TablePlan(table="b", sharding=DATA_PARALLEL, ranks=(1,))), "all 2"),
    ],
)
def test_invalid_plans(tables, message):
    with pytest.raises(DistcacheConfigError, match=message):
        plan_cost(Plan(name="bad", tables=tables), WORKLOAD, TOPOLOGY)


def test_column_wise_must_divide_dim():
    odd = dataclasses.replace(WORKLOAD, tables=(TableStats(name="a", rows=10, dim=7),))
    plan = Plan(name="cw", tables=(TablePlan(table="a", sharding=COLUMN_WISE, ranks=(0, 1)),))
    with pytest.raises(DistcacheConfigError, match="divisible"):
        plan_cost(plan, odd, TOPOLOGY)


def test_measured_lookup_rate_and_overlap_rule():
    table = WORKLOAD.tables[0]
    measured = dataclasses.replace(TOPOLOGY, lookup_rows_per_s=1e8)
    terms = _terms(table, measured)
    assert terms.lookup_s == pytest.approx((2 * 400 + 2 * terms.unique_rows_per_step) / 1e8)
    cache = {"storage": HOST_CACHED, "cache_fraction": 0.5}
    assert _terms(table, lookahead=4, prefetch_depth=1, **cache).staging_overlapped
    assert not _terms(table, lookahead=4, prefetch_depth=0, **cache).staging_overlapped
    assert not _terms(table, lookahead=0, prefetch_depth=0, **cache).staging_overlapped


def test_cpu_staging_is_never_hidden():
    """On CPU the stager copies on the training thread: look-ahead staging is still exposed."""
    cpu = dataclasses.replace(TOPOLOGY, compute_device="cpu")
    cache = {"storage": HOST_CACHED, "cache_fraction": 0.5, "lookahead": 4, "prefetch_depth": 1}
    table = WORKLOAD.tables[0]
    assert _terms(table, **cache).staging_overlapped
    assert not _terms(table, cpu, **cache).staging_overlapped
    rank = plan_cost(PLAN, WORKLOAD, cpu).per_rank[1]
    assert rank.exposed_staging_s == pytest.approx(rank.staging_s)


def test_data_parallel_tables_pay_a_dense_update():
    table = WORKLOAD.tables[0]  # 1000 rows of 16 floats (64 B, 2 sectors), 200 ids per rank
    dp = shard_terms(table, WORKLOAD, TOPOLOGY, Placement(sharding=DATA_PARALLEL, shards=2))
    lookups = 2 * 200 * 64 / 1e11
    assert dp.lookup_s == pytest.approx(lookups + DENSE_UPDATE_PASSES * 1000 * 64 / 1e11)
    measured = dataclasses.replace(TOPOLOGY, dense_update_bytes_per_s=1e9)
    dp = shard_terms(table, WORKLOAD, measured, Placement(sharding=DATA_PARALLEL, shards=2))
    assert dp.lookup_s == pytest.approx(lookups + 1000 * 64 / 1e9)


def test_measured_lookup_bytes_add_to_the_row_rate():
    table = WORKLOAD.tables[0]
    measured = dataclasses.replace(TOPOLOGY, lookup_rows_per_s=1e8, lookup_bytes_per_s=1e10)
    terms = _terms(table, measured)
    accesses = 2 * 400 + 2 * terms.unique_rows_per_step
    assert terms.lookup_s == pytest.approx(accesses / 1e8 + accesses * 64 / 1e10)


def test_device_tables_priced_at_the_fused_kernels_rate_cached_ones_at_ours():
    """`to_sharding_plan` serves device-stored tables by TorchRec's fused kernel and cached ones
    by distcache's: each is priced at its kernel's measured rate."""
    table = WORKLOAD.tables[0]
    measured = dataclasses.replace(TOPOLOGY, lookup_rows_per_s=1e7, device_lookup_rows_per_s=1e8)
    device = _terms(table, measured)
    assert device.lookup_s == pytest.approx((2 * 400 + 2 * device.unique_rows_per_step) / 1e8)
    cached = _terms(table, measured, storage=HOST_CACHED, cache_fraction=0.5, lookahead=4)
    assert cached.lookup_s == pytest.approx((2 * 400 + 2 * cached.unique_rows_per_step) / 1e7)
    # Without a measured fused rate, every table takes distcache's.
    ours_only = dataclasses.replace(measured, device_lookup_rows_per_s=None)
    assert _terms(table, ours_only).lookup_s == pytest.approx(
        (2 * 400 + 2 * device.unique_rows_per_step) / 1e7
    )


def test_fixed_costs_per_step_sharding_type_and_layer():
    costly = dataclasses.replace(
        TOPOLOGY,
        step_overhead_s=1e-3,
        sharding_overhead_s=2e-4,
        dense_layer_overhead_s=1e-5,
        dense_activation_bytes_per_s=1e9,
    )
    mixed = Plan(
        name="mixed",
        tables=(
            TablePlan(table="a", sharding=TABLE_WISE, ranks=(0,)),
            TablePlan(table="b", sharding=DATA_PARALLEL, ranks=(0, 1)),
        ),
    )
    base, cost = plan_cost(mixed, WORKLOAD, TOPOLOGY), plan_cost(mixed, WORKLOAD, costly)
    for plain, rank in zip(base.per_rank, cost.per_rank, strict=True):
        assert rank.overhead_s == pytest.approx(1e-3 + 2 * 2e-4)  # two sharding types
        # 5 layers: bottom 13->8->4, the interaction (12 inputs, 3 pairs), top 7->4->1;
        # activation elements per sample: sum of 3 * inputs + 7 * outputs.
        elements = (3 * 13 + 7 * 8) + (3 * 8 + 7 * 4) + (3 * 12 + 7 * 3) + (3 * 7 + 7 * 4)
        elements += 3 * 4 + 7 * 1
        extra = 5 * 1e-5 + 100 * elements * 4 / 1e9
        assert rank.dense_compute_s == pytest.approx(plain.dense_compute_s + extra)
        assert rank.all_reduce_s == pytest.approx(plain.all_reduce_s)
    assert cost.step_s > base.step_s
    only_tw = plan_cost(PLAN, WORKLOAD, costly).per_rank[0]
    assert only_tw.overhead_s == pytest.approx(1e-3 + 2e-4)


def test_measured_interaction_replaces_its_layer_by_hand():
    """With the interaction's costs measured, its flops and activations leave the dense
    layers and it costs B·(F·D·a + F²·b); the MLPs are priced as before."""
    layers = dataclasses.replace(
        TOPOLOGY, dense_layer_overhead_s=1e-5, dense_activation_bytes_per_s=1e9
    )
    measured = dataclasses.replace(
        layers, interaction_s_per_element=3e-9, interaction_s_per_pair=5e-10
    )
    plain = plan_cost(PLAN, WORKLOAD, layers).per_rank[0].dense_compute_s
    rank = plan_cost(PLAN, WORKLOAD, measured).per_rank[0].dense_compute_s
    # F = 3 vectors of D = 4 (2 tables + the bottom MLP's output), B = 100: the interaction's
    # layer had 2·F·F·D flops forward (x3 with backward) and 3·12 + 7·3 activation elements.
    as_layer = 3 * 2 * 3 * 3 * 4 * 100 / 1e12 + 100 * (3 * 12 + 7 * 3) * 4 / 1e9
    own = 100 * (3 * 4 * 3e-9 + 3 * 3 * 5e-10)
    assert rank == pytest.approx(plain - as_layer + own)  # one layer overhead either way


def test_latencies_per_routed_sharding_type():
    """Each sharding type routes ids with 3 collectives and embeddings with 2; data-parallel
    tables route nothing but add an all-reduce of their own."""
    two = global_terms(WORKLOAD, TOPOLOGY, 0.0, {TABLE_WISE, ROW_WISE})
    assert (two.input_latency_s, two.output_latency_s) == pytest.approx((6 * LATENCY, 4 * LATENCY))
    with_dp = global_terms(WORKLOAD, TOPOLOGY, 1000.0, {TABLE_WISE, DATA_PARALLEL})
    assert with_dp.input_latency_s == pytest.approx(3 * LATENCY)
    alone = global_terms(WORKLOAD, TOPOLOGY, 1000.0, {TABLE_WISE})
    assert with_dp.all_reduce_s == pytest.approx(alone.all_reduce_s)
    assert alone.all_reduce_s == pytest.approx(
        global_terms(WORKLOAD, TOPOLOGY, 0.0, {TABLE_WISE}).all_reduce_s + 1000 / 1e10 + LATENCY
    )
    one_rank = dataclasses.replace(TOPOLOGY, world_size=1)
    assert global_terms(WORKLOAD, one_rank, 0.0, {TABLE_WISE}).shared_s == 0.0
    # Ranks sharing cores: collectives entered from computation wait for a descheduled peer.
    shared = dataclasses.replace(TOPOLOGY, sync_latency_s=5 * LATENCY)
    synced = global_terms(WORKLOAD, shared, 1000.0, {TABLE_WISE, DATA_PARALLEL})
    assert synced.input_latency_s == pytest.approx(3 * LATENCY)  # back to back: no skew
    assert synced.output_latency_s == pytest.approx(2 * 5 * LATENCY)
    assert synced.all_reduce_s == pytest.approx(with_dp.all_reduce_s + 2 * 4 * LATENCY)


def test_victim_choice_scans_the_whole_cache_where_measured():
    table = TableStats(name="big", rows=200_000, dim=16, alpha=1.05)
    cache = {"storage": HOST_CACHED, "cache_fraction": 0.05, "lookahead": 8, "prefetch_depth": 1}
    plain = _terms(table, **cache)
    scanned = _terms(table, dataclasses.replace(TOPOLOGY, cache_scan_rows_per_s=1e7), **cache)
    # (on a GPU, the device's work: in the lookups, `test_the_scheduler_on_a_gpu_...`)
    assert scanned.lookup_s == pytest.approx(plain.lookup_s + 10_000 / 1e7)
    assert scanned.staging_s == plain.staging_s
    assert _terms(table, dataclasses.replace(TOPOLOGY, cache_scan_rows_per_s=1e7)).staging_s == 0
    lru = {**cache, "lookahead": 0, "prefetch_depth": 0}
    measured = dataclasses.replace(TOPOLOGY, cache_scan_rows_per_s=1e7)
    assert _terms(table, measured, **lru).lookup_s == _terms(table, **lru).lookup_s


def test_scheduled_candidates_by_hand():
    """The sweep of (K + 2)·U slots, at least 4096; every slot of a cache the sweep would
    cover or come within 2·U of."""
    assert SCHEDULER_MIN_SCAN == 4096
    assert scheduled_candidates(1_000_000, 100, 1) == 4096
    assert scheduled_candidates(1_000_000, 3000, 1) == 9000
    assert scheduled_candidates(1_000_000, 3000, 4) == 18000
    assert scheduled_candidates(4000, 100, 1) == 4000  # the sweep covers it
    assert scheduled_candidates(14_000, 3000, 1) == 14_000  # within 2·U: 9000 + 6000 >= 14000
    assert scheduled_candidates(16_000, 3000, 1) == 9000


CALIBRATED = dataclasses.replace(
    TOPOLOGY, cache_scan_rows_per_s=1e7, schedule_s_per_id=5e-8, schedule_s_per_candidate=8e-8
)


def _scheduling_s(table, topology, workload=WORKLOAD, **cache):
    """The scheduler's time in a cache's terms (its staging's on CPU, its lookups' on a GPU):
    with `topology`'s figures, less without any."""
    unpriced = dataclasses.replace(
        topology, cache_scan_rows_per_s=None, schedule_s_per_id=None, schedule_s_per_candidate=None
    )
    placement = Placement(sharding=TABLE_WISE, shards=1, **cache)
    priced = shard_terms(table, workload, topology, placement)
    plain = shard_terms(table, workload, unpriced, placement)
    added = priced.staging_s + priced.lookup_s - plain.staging_s - plain.lookup_s
    assert priced.scheduling_s == pytest.approx(added)
    return added, plain


def test_calibrated_scheduler_is_priced_per_id_and_candidate_not_per_slot():
    """Where calibrate measured the scheduler, a look-ahead cache's staging adds
    ids·schedule_s_per_id + candidates·schedule_s_per_candidate (by hand from the formula):
    more with more ids, the same for every cache the sweep does not cover, however large
    (the old pricing, every slot at cache_scan_rows_per_s, grows with it)."""
    table = TableStats(name="big", rows=2_000_000, dim=16, alpha=1.05)
    cache = {"storage": HOST_CACHED, "lookahead": 8, "prefetch_depth": 1}
    shares = []
    for fraction in (0.01, 0.05, 0.2):  # 20k to 400k slots, all of them swept in part
        share, terms = _scheduling_s(table, CALIBRATED, cache_fraction=fraction, **cache)
        u, n = terms.unique_rows_per_step, terms.ids_per_step
        assert n == 200 and 3 * u < 4096  # the sweep's minimum
        assert share == pytest.approx(n * 5e-8 + 4096 * 8e-8)
        scanned = dataclasses.replace(TOPOLOGY, cache_scan_rows_per_s=1e7)
        old, _ = _scheduling_s(table, scanned, cache_fraction=fraction, **cache)
        assert old == pytest.approx(fraction * 2_000_000 / 1e7)
        shares.append(share)
    assert shares[0] == pytest.approx(shares[-1])
    # 20x the ids: U rows a batch past the sweep's minimum, (K + 2)·U candidates.
    bigger = dataclasses.replace(WORKLOAD, batch_size_per_rank=2000)
    share, terms = _scheduling_s(table, CALIBRATED, bigger, cache_fraction=0.05, **cache)
    u, n = terms.unique_rows_per_step, terms.ids_per_step
    assert n == 4000 and 3 * u > 4096 and 5 * u < 100_000
    assert share == pytest.approx(n * 5e-8 + 3 * u * 8e-8)
    assert share > shares[0]
    # A small cache: the sweep covers it, every slot is a candidate.
    share, terms = _scheduling_s(table, CALIBRATED, cache_fraction=0.001, **cache)
    assert share == pytest.approx(terms.ids_per_step * 5e-8 + 2000 * 8e-8)


def test_calibrated_scheduler_is_not_priced_for_lru_or_a_cache_that_moves_nothing():
    table = TableStats(name="big", rows=200_000, dim=16, alpha=1.05)
    lru = {"storage": HOST_CACHED, "cache_fraction": 0.05, "lookahead": 0, "prefetch_depth": 0}
    assert _scheduling_s(table, CALIBRATED, **lru)[0] == 0
    whole = {**lru, "cache_fraction": 1.0, "lookahead": 8, "prefetch_depth": 1}
    assert _terms(table, CALIBRATED, **whole).staging_s == 0


def test_scheduler_figures_come_together():
    with pytest.raises(DistcacheConfigError, match="schedule_s_per_id"):
        dataclasses.replace(TOPOLOGY, schedule_s_per_id=5e-8)
    with pytest.raises(DistcacheConfigError, match="schedule_s_per_candidate"):
        dataclasses.replace(TOPOLOGY, schedule_s_per_id=5e-8, schedule_s_per_candidate=-1.0)
    old = {k: v for k, v in TOPOLOGY.to_dict().items() if not k.startswith("schedule_")}
    assert Topology.from_dict(old).schedule_s_per_id is None  # a file written before them


def test_half_precision_rows_halve_row_bytes_not_the_state_or_the_wire():
    """An fp16 table (`row_dtype_bytes=2`) under row-wise Adagrad: rows of 16 x 2 bytes plus a
    4-byte accumulator; host memory and staging shrink by that, the pooled output does not."""
    workload = dataclasses.replace(WORKLOAD, optimizer="rowwise_adagrad")
    full = TableStats(name="t", rows=50_000, dim=16, alpha=1.05)
    half = dataclasses.replace(full, row_dtype_bytes=2)
    assert workload.row_bytes(full) == 16 * 4 + 4 and workload.row_bytes(half) == 16 * 2 + 4
    kwargs = dict(storage=HOST_CACHED, cache_fraction=0.05, lookahead=8, prefetch_depth=1)
    a = shard_terms(full, workload, TOPOLOGY, Placement(sharding=ROW_WISE, shards=2, **kwargs))
    b = shard_terms(half, workload, TOPOLOGY, Placement(sharding=ROW_WISE, shards=2, **kwargs))
    assert b.loads_per_step == a.loads_per_step
    assert b.staging_bytes_per_step == pytest.approx(a.staging_bytes_per_step * 36 / 68)
    assert b.host_memory_bytes == a.host_memory_bytes * 36 // 68
    assert b.embedding_bytes_per_peer == a.embedding_bytes_per_peer  # fp32 outputs
    with pytest.raises(DistcacheConfigError, match="row_dtype_bytes must be"):
        TableStats(name="t", rows=10, dim=4, row_dtype_bytes=3)


# Two nodes of two ranks: NVLink inside a node, the NIC between them.
NODES = dataclasses.replace(TOPOLOGY, name="2x2", world_size=4, ranks_per_node=2)
ONE_TABLE = dataclasses.replace(
    WORKLOAD, tables=(TableStats(name="a", rows=1000, dim=8, pooling_factor=2, alpha=1.0),)
)


def _emb_traffic(sharding: str, ranks: tuple[int, ...]) -> list[tuple[float, ...]]:
    """(sent intra, sent inter, received intra, received inter) output bytes per rank."""
    from distcache.planner.ranks import shard_contribution
    from distcache.planner.shards import table_plan_terms

    table = TablePlan(table="a", sharding=sharding, ranks=ranks)
    terms = table_plan_terms(table, ONE_TABLE.tables[0], ONE_TABLE, NODES)
    load = shard_contribution(terms, ranks, NODES)
    return [tuple(float(row[r]) for row in load.emb) for r in range(NODES.world_size)]


def test_table_row_wise_output_by_hand():
    """TorchRec's TWRW on node 0 (ranks 0, 1): the node reduce-scatters its partial sums of all
    4 ranks' bags over NVLink, then rank j sends the rank of local index j on node 1 its bags
    over the NIC. B = 100, D = 8, fp32: one rank's bags are e = 3200 bytes."""
    e = 100 * 8 * 4
    twrw = _emb_traffic(TABLE_ROW_WISE, (0, 1))
    reduce_scatter = 1 / 2 * 4 * e  # (k - 1) / k of W ranks' bags
    assert twrw[0] == twrw[1] == (reduce_scatter, e, reduce_scatter, 0.0)
    assert twrw[2] == twrw[3] == (0.0, 0.0, 0.0, e)
    # Row-wise over the same ranks (the old reading of TWRW) sends each consumer the whole
    # partial sums: twice (k-fold) the bytes across nodes.
    rw = _emb_traffic(ROW_WISE, (0, 1))
    assert rw[0] == (e, 2 * e, e, 0.0) and rw[2] == (0.0, 0.0, 0.0, 2 * e)
    # Priced in a plan: its rows split over the node, one more output collective each way.
    plan = Plan(name="twrw", tables=(TablePlan(table="a", sharding=TABLE_ROW_WISE, ranks=(0, 1)),))
    cost = plan_cost(plan, ONE_TABLE, NODES)
    rw_plan = Plan(name="rw", tables=(TablePlan(table="a", sharding=ROW_WISE, ranks=(0, 1)),))
    as_rw = plan_cost(rw_plan, ONE_TABLE, NODES)
    assert cost.per_rank[0].lookup_s == pytest.approx(as_rw.per_rank[0].lookup_s)
    assert cost.per_rank[2].input_all_to_all_s == pytest.approx(
        as_rw.per_rank[2].input_all_to_all_s
    )
    # Rank 2 receives e (not 2 e) each way, and waits on two output collectives, not one.
    latency_rw = as_rw.per_rank[2].output_all_to_all_s - 2 * 2 * e / 1e10
    latency = cost.per_rank[2].output_all_to_all_s - 2 * e / 1e10
    assert latency == pytest.approx(2 * latency_rw) and latency_rw > 0
    assert cost.device_memory_bytes == as_rw.device_memory_bytes == (500 * 32, 500 * 32, 0, 0)


def test_grid_output_by_hand():
    """A table-row-wise table over both nodes (TorchRec's grid): a column block of 4 per node,
    rows over the node's 2 ranks. e = 100 * 4 * 4 bytes per rank's bags per block."""
    e = 100 * 4 * 4
    grid = _emb_traffic(TABLE_ROW_WISE, (0, 1, 2, 3))
    for rank in range(4):  # reduce-scatter in the node; one block to and from the other node
        assert grid[rank] == (1 / 2 * 4 * e, e, 1 / 2 * 4 * e, e)


@pytest.mark.parametrize("ranks", [(0, 2), (1, 2), (0,), (0, 1, 2)])
def test_table_row_wise_spans_whole_nodes(ranks):
    plan = Plan(name="bad", tables=(TablePlan(table="a", sharding=TABLE_ROW_WISE, ranks=ranks),))
    with pytest.raises(DistcacheConfigError, match="whole nodes"):
        plan_cost(plan, ONE_TABLE, NODES)


SEQUENCE = Workload(
    name="seq",
    tables=(
        TableStats(name="a", rows=1000, dim=16, pooling_factor=2, alpha=1.0, pooled=False),
        TableStats(name="b", rows=500, dim=8, pooling_factor=1, alpha=1.2),
    ),
    batch_size_per_rank=100,
    bottom_mlp=(8, 4),
    top_mlp=(4, 1),
)


@pytest.mark.parametrize(
    ("sharding", "ranks", "rows_sent"),
    [
        (TABLE_WISE, (0,), 100 * 2),  # every id of rank 1's batch, one row each
        (ROW_WISE, (0, 1), 100 * 2 / 2),  # the half of them the shard holds
        (COLUMN_WISE, (0, 1), 100 * 2),  # every id, half the columns
    ],
)
def test_sequence_table_outputs_a_row_per_id_by_hand(sharding, ranks, rows_sent):
    """A sequence table (an `EmbeddingCollection`'s) sends one output row per id, not per bag:
    B·P·D_shard·4 bytes to each consumer (row-wise: the B·P/S ids the shard served), through an
    all-to-all even row-wise (no reduce-scatter, so no row-wise slowdown); with hot rows only
    the cold ids' rows. A pooled table of the same shape sends B·D_shard·4."""
    slow = dataclasses.replace(TOPOLOGY, row_wise_output_slowdown=4.0)
    width = 16 // (2 if sharding == COLUMN_WISE else 1)
    sequence, pooled = SEQUENCE.tables[0], WORKLOAD.tables[0]
    terms = shard_terms(sequence, SEQUENCE, slow, Placement(sharding=sharding, shards=len(ranks)))
    assert terms.embedding_bytes_per_peer == pytest.approx(rows_sent * width * 4)
    assert terms.collectives == f"{sharding}/sequence"
    bags = shard_terms(pooled, WORKLOAD, TOPOLOGY, Placement(sharding=sharding, shards=len(ranks)))
    assert bags.embedding_bytes_per_peer == 100 * width * 4
    assert bags.collectives == sharding
    hot = shard_terms(
        sequence, SEQUENCE, slow, Placement(sharding=sharding, shards=len(ranks), hot_rows=30)
    )
    mass = AccessProfile.power_law(1000, 1.0).probabilities[:30].sum()
    assert hot.embedding_bytes_per_peer == pytest.approx(rows_sent * width * 4 * (1 - mass))
    plan = Plan(
        name="seq",
        tables=(
            TablePlan(table="a", sharding=sharding, ranks=ranks),
            TablePlan(table="b", sharding=TABLE_WISE, ranks=(1,)),
        ),
    )
    sent = all_to_all_sent_bytes(plan, SEQUENCE, TOPOLOGY)
    ids = {TABLE_WISE: 100 * 2 * 8, ROW_WISE: 100 * 2 / 2 * 8, COLUMN_WISE: 100 * 2 * 8}
    # Rank 0 sends b's ids to rank 1 (b's shard), a's ids to a's shard there (row- and
    # column-wise), a's rows to rank 1, and in backward the gradients of what it received: b's
    # outputs, and a's rows from a's shard on rank 1 (row- and column-wise).
    split = sharding != TABLE_WISE
    a_rows = rows_sent * width * 4
    b_grads = 100 * 8 * 4
    b_ids = 100 * 8
    assert sent[0] == pytest.approx(b_ids + ids[sharding] * split + a_rows * (1 + split) + b_grads)
    assert sent[1] == pytest.approx(ids[sharding] + b_grads + a_rows * (1 + split))


def test_a_sequence_sharding_type_takes_collectives_of_its_own():
    """An `EmbeddingCollection`'s sharding runs its own input and output dists beside the bag
    collection's of the same type: a pooled and a sequence row-wise table pay two types'
    latencies; the calibrated row-wise output latency is the pooled one's only."""
    rw = Plan(
        name="rw",
        tables=(
            TablePlan(table="a", sharding=ROW_WISE, ranks=(0, 1)),
            TablePlan(table="b", sharding=ROW_WISE, ranks=(0, 1)),
        ),
    )
    slow = dataclasses.replace(TOPOLOGY, row_wise_output_latency_s=3e-4)
    pooled = plan_cost(rw, WORKLOAD, slow).per_rank[0]
    mixed = plan_cost(rw, SEQUENCE, slow).per_rank[0]
    # the same ids' bytes, one more type's 3 input collectives
    assert mixed.input_all_to_all_s - pooled.input_all_to_all_s == pytest.approx(3 * LATENCY)
    sequence_only = Workload(
        name="s",
        tables=tuple(dataclasses.replace(t, pooled=False) for t in WORKLOAD.tables),
        batch_size_per_rank=100,
        bottom_mlp=(8, 4),
        top_mlp=(4, 1),
    )
    alone = global_terms(sequence_only, slow, 0.0, {"row_wise/sequence"})
    both = global_terms(sequence_only, slow, 0.0, {"row_wise/sequence", ROW_WISE})
    assert alone.input_latency_s == pytest.approx(3 * LATENCY)
    assert both.input_latency_s == pytest.approx(6 * LATENCY)
    assert alone.output_latency_s == pytest.approx(2 * LATENCY)  # no row-wise output latency
    assert both.output_latency_s == pytest.approx(4 * LATENCY + 3e-4)


def test_sequence_tables_are_not_table_row_wise():
    four = dataclasses.replace(TOPOLOGY, world_size=4, ranks_per_node=2)
    plan = Plan(
        name="twrw",
        tables=(
            TablePlan(table="a", sharding=TABLE_ROW_WISE, ranks=(0, 1)),
            TablePlan(table="b", sharding=TABLE_WISE, ranks=(1,)),
        ),
    )
    plan_cost(plan, WORKLOAD, four)  # a pooled table may be
    with pytest.raises(DistcacheConfigError, match="'a' is a sequence table .*not table_row_wise"):
        plan_cost(plan, SEQUENCE, four)


def test_pooled_must_be_a_bool():
    with pytest.raises(DistcacheConfigError, match="pooled must be true or false, got 'no'"):
        TableStats(name="a", rows=10, dim=4, pooled="no")


def test_a_reactive_caches_own_work_is_priced_per_id_on_a_gpu_where_calibrated():
    """`reactive_cache_s_per_id` (FBGEMM's UVM cache, calibrated on a GPU) adds each id of an
    LRU cache's step to its lookups there, in place of its staging (the figure is the UVM
    cache's whole step less FBGEMM's every-row-in-HBM step: its copies are in it); nothing
    changes for a look-ahead cache (its scheduler is priced apart), on CPU, or without the
    figure."""
    table = TableStats(name="big", rows=200_000, dim=16, alpha=1.05)
    lru = {"storage": HOST_CACHED, "cache_fraction": 0.05, "lookahead": 0, "prefetch_depth": 0}
    ahead = {**lru, "lookahead": 8, "prefetch_depth": 1}
    calibrated = dataclasses.replace(TOPOLOGY, reactive_cache_s_per_id=1e-8)
    plain = _terms(table, **lru)
    priced = _terms(table, calibrated, **lru)
    assert priced.lookup_s == pytest.approx(plain.lookup_s + plain.ids_per_step * 1e-8)
    assert plain.staging_s > 0 and priced.staging_s == 0
    assert priced.staging_bytes_per_step == plain.staging_bytes_per_step  # still reported
    assert _terms(table, calibrated, **ahead).staging_s == _terms(table, **ahead).staging_s
    assert _terms(table, calibrated, **ahead).lookup_s == _terms(table, **ahead).lookup_s
    cpu = dataclasses.replace(calibrated, compute_device="cpu")
    cpu_plain = _terms(table, dataclasses.replace(TOPOLOGY, compute_device="cpu"), **lru)
    assert _terms(table, cpu, **lru).lookup_s == cpu_plain.lookup_s
    assert _terms(table, cpu, **lru).staging_s == cpu_plain.staging_s > 0
    with pytest.raises(DistcacheConfigError, match="reactive_cache_s_per_id"):
        dataclasses.replace(TOPOLOGY, reactive_cache_s_per_id=0.0)


def test_a_reactive_caches_misses_are_priced_per_miss_on_a_gpu_where_calibrated():
    """`reactive_cache_s_per_miss` (FBGEMM's UVM cache at two sizes) adds each row an LRU
    cache loads to its lookups on a GPU, as the cache's own work (`scheduling_s`): a smaller
    cache, loading more, costs more; nothing for a look-ahead cache, on CPU, or without the
    per-id figure (which the topology refuses)."""
    table = TableStats(name="big", rows=200_000, dim=16, alpha=1.05)
    lru = {"storage": HOST_CACHED, "lookahead": 0, "prefetch_depth": 0}
    per_id = dataclasses.replace(TOPOLOGY, reactive_cache_s_per_id=1e-8)
    both = dataclasses.replace(per_id, reactive_cache_s_per_miss=4e-7)
    for fraction in (0.01, 0.05):
        plain, priced = (_terms(table, t, cache_fraction=fraction, **lru) for t in (per_id, both))
        assert priced.scheduling_s == pytest.approx(plain.loads_per_step * 4e-7)
        assert priced.scheduling_s > 0
        assert priced.lookup_s == pytest.approx(plain.lookup_s + priced.scheduling_s)
        assert priced.staging_s == plain.staging_s == 0
    small, large = (_terms(table, both, cache_fraction=f, **lru) for f in (0.01, 0.05))
    assert small.scheduling_s > large.scheduling_s
    ahead = {**lru, "cache_fraction": 0.05, "lookahead": 8, "prefetch_depth": 1}
    assert _terms(table, both, **ahead).lookup_s == _terms(table, per_id, **ahead).lookup_s
    cpu = {"compute_device": "cpu"}
    cpu_terms = [_terms(table, dataclasses.replace(t, **cpu), cache_fraction=0.05, **lru)
                 for t in (per_id, both)]  # fmt: skip
    assert cpu_terms[0] == cpu_terms[1]
    with pytest.raises(DistcacheConfigError, match="reactive_cache_s_per_miss needs"):
        dataclasses.replace(TOPOLOGY, reactive_cache_s_per_miss=4e-7)


def test_shard_terms_made_without_the_dataclass_init_equal_it():
    """`shard_terms` builds its `ShardTerms` past the frozen `__init__` (`ShardTerms.of`) and
    `reduced_as` replaces fields the same way (`replaced`): the results are the dataclass's own,
    every field set, equal and hashed alike, still frozen; a known `shard_access` changes
    nothing."""
    placements = [
        Placement(sharding=TABLE_WISE, shards=1),
        Placement(sharding=DATA_PARALLEL, shards=2),
        Placement(sharding=ROW_WISE, shards=2, hot_rows=10),
        Placement(
            sharding=ROW_WISE,
            shards=2,
            storage=HOST_CACHED,
            cache_fraction=0.5,
            lookahead=4,
            prefetch_depth=1,
            hot_rows=5,
            hot_reduce="touched",
        ),
    ]
    names = [f.name for f in dataclasses.fields(ShardTerms)]
    for table in WORKLOAD.tables:
        for placement in placements:
            terms = shard_terms(table, WORKLOAD, TOPOLOGY, placement)
            made = ShardTerms(**{name: getattr(terms, name) for name in names})
            assert terms == made and hash(terms) == hash(made)
            assert terms.replaced(hot_rows=3, lookup_s=1.0) == dataclasses.replace(
                made, hot_rows=3, lookup_s=1.0
            )
            with pytest.raises(dataclasses.FrozenInstanceError):
                terms.lookup_s = 0.0
            access = shard_access(
                table,
                WORKLOAD,
                TOPOLOGY,
                sharding=placement.sharding,
                shards=placement.shards,
                hot_rows=placement.hot_rows if placement.sharding != DATA_PARALLEL else 0,
            )
            assert shard_terms(table, WORKLOAD, TOPOLOGY, placement, access) == terms


def test_shared_terms_kept_per_set_of_collectives_equal_fresh_ones():
    """`SharedTerms` (one per solve) keeps what depends only on the set of collectives: reused
    across plans of other sets, with replicas and without, it prices each as a fresh one and
    as `global_terms` does."""
    topology = dataclasses.replace(
        TOPOLOGY,
        world_size=16,
        ranks_per_node=8,
        sync_latency_s=3e-5,
        row_wise_output_latency_s=7e-6,
        sharding_overhead_s=1e-4,
        id_overhead_s=1e-8,
    )
    kept = SharedTerms(WORKLOAD, topology)
    sets = [
        (),
        (TABLE_WISE,),
        (ROW_WISE, TABLE_WISE),
        (TABLE_ROW_WISE, COLUMN_WISE, DATA_PARALLEL),
        (DATA_PARALLEL,),
        ("row_wise/sequence", ROW_WISE),
    ]
    for kinds in sets * 2:
        for dp_bytes, hot_tables, gathered in ((0.0, 0, 0), (4e6, 2, 0), (0.0, 2, 2), (1.0, 3, 1)):
            args = (dp_bytes, kinds, 37.0, 1e5 * hot_tables, hot_tables, 5e4 * gathered, gathered)
            fresh = SharedTerms(WORKLOAD, topology).parts(*args)
            assert kept.parts(*args) == fresh
            assert kept.shared_s(*args) == global_terms(WORKLOAD, topology, *args).shared_s
            assert fresh[1] > 0 or not set(kinds) - {DATA_PARALLEL}  # routed: input latency


@pytest.mark.parametrize("world_size, ranks_per_node", [(1, 1), (8, 8), (16, 8), (128, 8)])
def test_shared_terms_of_many_plans_equal_each_priced_alone_to_the_bit(world_size, ranks_per_node):
    """`SharedTerms.shared_rows_s` (the solver prices its trials' rows together) equals
    `shared_s` of each row, bit for bit: with and without data-parallel bytes, replicas
    reduced both ways, nothing to gather, on one rank and on several nodes."""
    topology = dataclasses.replace(
        TOPOLOGY,
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        sync_latency_s=3e-5,
        row_wise_output_latency_s=7e-6,
        sharding_overhead_s=1e-4,
        id_overhead_s=1e-8,
    )
    shared = SharedTerms(WORKLOAD, topology)
    rng = np.random.default_rng(7)
    sets = [
        frozenset(),
        frozenset({TABLE_WISE}),
        frozenset({ROW_WISE, TABLE_WISE, COLUMN_WISE}),
        frozenset({TABLE_ROW_WISE, DATA_PARALLEL}),
    ]
    kinds, rows = [], []
    for _ in range(200):
        hot_tables = int(rng.integers(0, 4))
        gathered = int(rng.integers(0, hot_tables + 1))
        dp = float(rng.choice([0.0, rng.uniform(1, 1e9)]))
        gather = float(rng.choice([0.0, rng.uniform(1, 1e7)])) if gathered else 0.0
        hot_bytes = rng.uniform(1, 1e8) if hot_tables > gathered else 0.0
        rows.append((dp, rng.uniform(0, 1e5), hot_bytes, hot_tables, gather, gathered))
        kinds.append(sets[int(rng.integers(len(sets)))])
    together = shared.shared_rows_s(kinds, np.array(rows, dtype=np.float64))
    alone = [
        shared.shared_s(dp, k, sent, hot, int(ht), gather, int(g))
        for k, (dp, sent, hot, ht, gather, g) in zip(kinds, rows, strict=True)
    ]
    assert together.tolist() == alone
