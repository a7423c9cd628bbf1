"""Seconds a step from the topology's rates: a shard's lookups and updates, a data-parallel
table's dense update, a cache's staging across the host link and its scheduler's (or a
reactive cache's) own work. `shards.shard_terms` sums them into a shard's terms; `caches.py`
prices a cache shared by several tables with the same functions. The formulas are in
`cost.py`'s docstring.

Example::

    seconds = lookup_time_s(ids=65536, unique_rows=20000, dim_bytes=256, row_bytes=512,
                            topology=topology)
"""

from __future__ import annotations

from distcache.planner.types import Topology

ACCESS_BYTES = 32  # granularity of random memory access (a GPU DRAM sector)
# Passes over a data-parallel table's rows per step without a measured rate: fill the dense
# gradient, then the optimizer reads it and the weights and writes the weights.
DENSE_UPDATE_PASSES = 4


def lookup_time_s(
    *,
    ids: float,
    unique_rows: float,
    dim_bytes: int,
    row_bytes: int,
    topology: Topology,
    device_stored: bool = False,
) -> float:
    """Forward + backward of an embedding-bag shard (see the module docstring).

    Args:
        ids: lookups served per step.
        unique_rows: rows updated per step.
        dim_bytes: bytes of the embedding part of a row (what the forward reads).
        row_bytes: bytes of a stored row with its optimizer state (what the update touches).
        topology: gives the device memory bandwidth or measured `lookup_rows_per_s`.
        device_stored: served by TorchRec's fused kernel (a device-stored or data-parallel
            table), at `device_lookup_rows_per_s` where that is measured.
    """
    rows_per_s, bytes_per_s = topology.lookup_rows_per_s, topology.lookup_bytes_per_s
    if device_stored and topology.device_lookup_rows_per_s:
        rows_per_s, bytes_per_s = (
            topology.device_lookup_rows_per_s,
            topology.device_lookup_bytes_per_s,
        )
    if rows_per_s:
        seconds = (2 * ids + 2 * unique_rows) / rows_per_s
        if bytes_per_s:
            traffic = 2 * ids * dim_bytes + 2 * unique_rows * row_bytes
            seconds += traffic / bytes_per_s
        return seconds
    read, update = _sectors(dim_bytes), _sectors(row_bytes)
    return (2 * ids * read + 2 * unique_rows * update) / topology.device_memory_bw_bytes_per_s


def dense_update_time_s(table_bytes: float, topology: Topology) -> float:
    """A data-parallel table's dense gradient and update over all of its `table_bytes` (rows
    with their optimizer state), once per step."""
    if topology.dense_update_bytes_per_s:
        return table_bytes / topology.dense_update_bytes_per_s
    return DENSE_UPDATE_PASSES * table_bytes / topology.device_memory_bw_bytes_per_s


def _sectors(num_bytes: int) -> int:
    """Bytes a random row access moves: whole `ACCESS_BYTES` sectors (a narrow column-wise
    shard does not read less than one sector per row)."""
    return -(-num_bytes // ACCESS_BYTES) * ACCESS_BYTES


def staging_time_s(staging_bytes: float, topology: Topology, scheduling_s: float = 0.0) -> float:
    """Host-device time of a cache's traffic per step: one load and one write-back transfer,
    half of `staging_bytes` each (as many write-backs as loads), the write-backs at
    `device_to_host_bw_bytes_per_s` where the topology has it, and its scheduler's
    `scheduling_s` (`scheduling_time_s`), when it moves anything."""
    if staging_bytes <= 0:
        return 0.0
    to_device = topology.host_to_device_bw_bytes_per_s
    to_host = topology.device_to_host_bw_bytes_per_s or to_device
    return (
        staging_bytes / 2 / to_device
        + staging_bytes / 2 / to_host
        + 2 * topology.host_to_device_latency_s
        + scheduling_s
    )


def scheduling_time_s(
    topology: Topology, *, cache_rows: int, ids: float, unique_rows: float, prefetch_depth: int
) -> float:
    """A look-ahead cache's scheduler time per step, where the topology measures it.

    Calibrated (`Topology.schedule_s_per_id`): the `ids` entering the window plus the slots
    its victim choice scores (`scheduled_candidates`), each at its measured cost. (The
    scheduler's fixed cost per batch is not priced: the tables of one width on a rank share
    one cache engine, whose calls a shard's terms cannot apportion.) Else (presets, topologies
    calibrated before those figures): every one of the cache's `cache_rows` slots at
    `cache_scan_rows_per_s`, or nothing where that is None."""
    per_id, per_candidate = topology.schedule_s_per_id, topology.schedule_s_per_candidate
    if per_id is None or per_candidate is None:
        rate = topology.cache_scan_rows_per_s
        return cache_rows / rate if rate else 0.0
    candidates = scheduled_candidates(cache_rows, unique_rows, prefetch_depth)
    return ids * per_id + candidates * per_candidate


def cache_work_on_device(topology: Topology) -> bool:
    """Whether a cache's own work (a look-ahead cache's scheduler; a reactive cache's lookups
    and inserts, `reactive_cache_time_s`) is priced as the device's beside training (a GPU:
    its kernels take the device's time, calibrated so, while the copies overlap the step on
    the staging stream) rather than as part of the staging (CPU, where the stager runs in
    program order on the training thread and all of it is exposed anyway)."""
    return topology.compute_device == "cuda"


def reactive_cache_time_s(topology: Topology, ids: float, cached: bool, lookahead: int) -> float:
    """A reactive cache's own device work per step on a GPU: `ids` at the topology's
    `reactive_cache_s_per_id` (FBGEMM's UVM cache's, as calibrated); 0 elsewhere, and where
    it is not measured. Per id, so the caches a rank's tables share add up alike."""
    if not reactive_cache_priced_per_id(topology, cached, lookahead):
        return 0.0
    return ids * topology.reactive_cache_s_per_id


def cache_work_s(
    topology: Topology, *, lookahead: int, loads: float, cache_rows: int, ids: float,
    unique_rows: float, prefetch_depth: int,
) -> float:  # fmt: skip
    """A cache's own work per step beside its lookups (`ShardTerms.scheduling_s`): a look-ahead
    cache's scheduler (`scheduling_time_s`), a reactive cache's misses where they were measured
    (`reactive_cache_miss_s`)."""
    if lookahead > 0:
        return scheduling_time_s(
            topology, cache_rows=cache_rows, ids=ids, unique_rows=unique_rows,
            prefetch_depth=prefetch_depth,
        )  # fmt: skip
    return reactive_cache_miss_s(topology, loads)


def cache_staging(
    topology: Topology, staging_bytes: float, work_s: float, lookahead: int
) -> tuple[float, float]:
    """(its own work, its staging time) per step of a cache that moves `staging_bytes` (loads
    and write-backs) a step and whose own work (`cache_work_s`) is `work_s`: no work where it
    moves nothing (no victims to choose); the work part of the staging unless
    `cache_work_on_device`; no staging where its figures hold its copies
    (`reactive_cache_priced_per_id`)."""
    work_s *= staging_bytes > 0
    if reactive_cache_priced_per_id(topology, True, lookahead):
        return work_s, 0.0
    exposed = work_s * (not cache_work_on_device(topology))
    return work_s, staging_time_s(staging_bytes, topology, exposed)


def reactive_cache_miss_s(topology: Topology, loads: float) -> float:
    """A reactive cache's own device work per step for the `loads` rows it loads a step, on a
    GPU whose topology measured it (`reactive_cache_s_per_miss`: FBGEMM's UVM cache at two
    sizes); 0 elsewhere. The cache's `scheduling_s` (its work beside its lookups, as a
    look-ahead cache's scheduler): a cache shared by tables prices it once, on its shared
    loads (`caches.py`)."""
    per_miss = topology.reactive_cache_s_per_miss  # (only beside a per-id figure: `Topology`)
    if not (per_miss and cache_work_on_device(topology)):
        return 0.0
    return loads * per_miss


def reactive_cache_priced_per_id(topology: Topology, cached: bool, lookahead: int) -> bool:
    """Whether a cache's work is `reactive_cache_time_s`'s: a reactive cache on a GPU whose
    topology measured it. That figure is FBGEMM's UVM cache's whole step less its every-row-in-
    HBM step (`tools/uvmbench.py`): its misses' copies and dirty rows' write-backs are in it, so
    such a cache has no staging term of its own (it would count them twice)."""
    per_id = topology.reactive_cache_s_per_id
    return bool(cached and lookahead == 0 and per_id and cache_work_on_device(topology))


SCHEDULER_MIN_SCAN = 4096  # `distcache.cache.scheduler.MIN_SCAN`: the shortest sweep


def scheduled_candidates(cache_rows: int, unique_rows: float, prefetch_depth: int) -> float:
    """Slots a look-ahead cache's scheduler scores per batch to choose victims, as the engine
    offers them (`distcache.cache.victims.Victims.choose`) once the cache is full.

    A batch of U distinct rows is staged while the K batches staged before it are still
    pinned, so `Scheduler._scan` sweeps their (K + 1)·U pinned rows (its own included) plus
    U, at least `SCHEDULER_MIN_SCAN` slots: max(4096, (K + 2)·U). Every slot of the cache
    instead where the sweep would cover it, or come within 2·U of it.

    Args:
        cache_rows: the cache's slots.
        unique_rows: U, the distinct rows of a batch.
        prefetch_depth: K, the batches staged ahead of the one training.
    """
    sweep = max(SCHEDULER_MIN_SCAN, (prefetch_depth + 2) * unique_rows)
    if sweep >= cache_rows or (prefetch_depth + 4) * unique_rows >= cache_rows:
        return float(cache_rows)
    return sweep
