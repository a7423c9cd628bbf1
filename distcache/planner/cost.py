"""The planner's cost model: the modelled step time and memory of a plan, as plain arithmetic.

Notation (per step): B = batch per rank, W = ranks, G = B·W the global batch, and for a table
R rows, D dim, P ids per sample, e = D·dtype the bytes of an embedding row and r = e + optimizer
state the bytes of a stored row. A shard of S serves n ids touching U distinct rows:
table-wise n = G·P (S = 1), row-wise n = G·P/S (hashed ids spread evenly), column-wise n = G·P
with rows of D/S columns, data parallel n = B·P per rank; U = U_table(G·P)/S for row-wise and
U_table(n) otherwise, from `stats.expected_unique`.

- lookup (fwd + bwd) = (2·n·e + 2·U·r) / device memory bandwidth: the forward gathers n rows,
  the backward scatters n gradients and reads + writes each touched row with its optimizer
  state; e and r rounded up to 32-byte sectors (random access moves no less). With
  `lookup_rows_per_s` set (a measured CPU): (2·n + 2·U) / lookup_rows_per_s, plus
  (2·n·e + 2·U·r) / lookup_bytes_per_s when that is measured too (wide rows cost more).
- data-parallel tables: the lookup of their n ids with U = 0, plus a dense update: their
  gradient is a whole [R, D] tensor, filled, accumulated and applied by the optimizer, so
  R·r bytes stream through memory `DENSE_UPDATE_PASSES` times (or at the measured
  `dense_update_bytes_per_s`).
- staging (host-cached shards) = 2·loads·r / host-device bandwidth + 2 transfer latencies:
  loads per step from `expected_loads` — 'frequency' with look-ahead (L > 0), 'lru' without —
  and as many write-backs (nearly every victim was trained). With L > 0 and K > 0 on a GPU it
  overlaps the rank's compute (dense + lookup), on the stager's own stream: exposed =
  max(0, staging - compute); else, and always on CPU (the stager copies in program order on
  the training thread), fully exposed. The cache must hold the rows of the K + 1 batches in
  flight: cache rows >= (K + 1)·U. On a calibrated CPU the host-device bandwidth is the
  stager's measured rate, its scheduler's work per row included, and a look-ahead cache
  scores every slot once per step to pick victims: + cache rows / cache_scan_rows_per_s
  (LRU's score is one subtraction per slot, not priced).
- all-to-all: each consumer rank sends B·P·8 bytes of ids to each shard (row-wise: /S) and each
  shard sends B·D_shard·dtype bytes of pooled embeddings (row-wise: partial sums, D) to each
  consumer; backward sends the gradients back the same way. A rank's time per collective is
  max(max(sent, received) over NVLink / intra bandwidth, same over the NIC / inter bandwidth):
  links are full duplex and both kinds run at once. Latencies: each sharding type a plan uses
  (data parallel aside) routes its ids with 3 collectives (TorchRec's splits, lengths and
  values all-to-alls), back to back as a step starts, each one network latency, and its
  embeddings with 2 (forward, backward), each entered from the rank's own computation: a
  `sync_latency_s`, which on cores shared by ranks holds the wait for a descheduled peer.
- all-reduce (dense MLP parameters + data-parallel tables' gradients, X bytes), hierarchical:
  2·(k-1)/k·X / intra + 2·(N-1)/N·X/k / inter for N nodes of k ranks, plus a sync latency
  (two with data-parallel tables: TorchRec all-reduces their gradients apart from the MLPs').
- dense compute = 3 · DLRM forward flops per sample · B / dense_flops_per_s, plus per step
  `dense_layer_overhead_s` for each layer (MLP layers and the interaction) and, when
  `dense_activation_bytes_per_s` is measured, the layers' activation traffic (per layer of
  i inputs and o outputs, B·dtype·(3·i + 7·o) bytes: the forward product and bias + ReLU, the
  ReLU's gradient, both backward products) at that rate.
- overhead = step_overhead_s + sharding_overhead_s per sharding type the plan uses +
  id_overhead_s per id the rank sends (B·P per table; column-wise: to each of its S shards):
  host time a CPU spends in the framework; the shard serving an id pays id_overhead_s too,
  in its lookup. These, the per-layer cost, the activation rate and
  the per-byte lookup cost are measured on CPU by `python -m distcache calibrate`; the GPU
  presets leave them at defaults that add nothing (asynchronous launches hide host time).
- step (per rank) = overhead + dense + lookup + exposed staging + all-to-alls + all-reduce;
  the plan's step is the slowest rank's.
- memory: device = shard rows·r (device storage), or cache rows·(r + 40 B slot metadata) +
  shard rows·(32 B look-ahead / 8 B LRU index), + data-parallel tables R·r on every rank;
  host = shard rows·r for host-cached shards. Row-wise shards are priced at ceil(R/S) rows.

Statistics come from a `BinnedProfile` of each table (rows grouped into bins of near-equal
probability), so a 40M-row table costs a few thousand operations per query; it agrees with
the exact `AccessProfile` functions to well under 1 % (tests/unit/planner/test_cost.py).

Example::

    cost = plan_cost(plan, workload, topology)
    print(cost.step_s, cost.fits, cost.violations)
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from distcache.errors import DistcacheConfigError
from distcache.planner.stats import AccessProfile
from distcache.planner.types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    DEVICE,
    HOST_CACHED,
    OPTIMIZER_STATE,
    ROW_WISE,
    Plan,
    PlanCost,
    StepCost,
    TablePlan,
    TableStats,
    Topology,
    Workload,
)

ID_BYTES = 8  # int64 ids in the input all-to-all
# Device metadata of a distcache cache (cache/residency.py, cache/policies.py):
CACHE_ROW_INDEX_BYTES_LOOKAHEAD = 8  # per shard row: slot map + latest window position (int32)
CACHE_ROW_INDEX_BYTES_REACTIVE = 8  # per shard row: slot map (int64), LRU policy
CACHE_SLOT_BYTES = 40  # per slot: row map, stamp, next use, count (int64), dirty, pin
ACCESS_BYTES = 32  # granularity of random memory access (a GPU DRAM sector)
# Passes over a data-parallel table's rows per step without a measured rate: fill the dense
# gradient, then the optimizer reads it and the weights and writes the weights.
DENSE_UPDATE_PASSES = 4
INPUT_COLLECTIVES = 3  # per sharding type: TorchRec's splits, lengths and values all-to-alls
OUTPUT_COLLECTIVES = 2  # per sharding type: pooled embeddings forward, gradients backward
# Activation traffic per dense layer, in elements of its input (i) and output (o) per sample:
# forward product reads i, writes o; bias + ReLU read and write o; ReLU backward reads the
# gradient and the output and writes o; the backward products read o twice, read i, write i.
ACTIVATION_IN_PASSES, ACTIVATION_OUT_PASSES = 3, 7

# ---------------------------------------------------------------------------------------------
# Access statistics on a binned profile
# ---------------------------------------------------------------------------------------------

_HEAD_ROWS = 1024  # the likeliest rows, one bin each
_BIN_GROWTH = 1 / 64  # beyond the head, a bin spans rows [k, k·(1 + growth)) of the ranking


class BinnedProfile:
    """A table's sorted access profile with the tail in geometric bins of rows.

    Within a bin the probabilities differ by at most a factor (1 + 1/64)^alpha, so the bin's
    mean stands for each of its rows; a power law is binned analytically (no per-row array).
    Results are memoized per (n, capacity, model).

    Args:
        rows_per_bin: rows in each bin, most likely bin first.
        probability: the mean lookup probability of one row of each bin.
    """

    def __init__(self, rows_per_bin: np.ndarray, probability: np.ndarray):
        self.rows_per_bin = np.asarray(rows_per_bin, dtype=np.float64)  # [bins]
        self.probability = np.asarray(probability, dtype=np.float64)  # [bins]
        self.rows_through = np.cumsum(self.rows_per_bin)  # [bins] rows up to each bin's end
        self.rows = int(round(self.rows_through[-1]))
        self._memo: dict[tuple, float | np.ndarray] = {}

    @staticmethod
    def _edges(rows: int) -> np.ndarray:
        """Bin boundaries over ranks [0, rows): 0, 1, .., head, then geometric."""
        head = np.arange(min(rows, _HEAD_ROWS) + 1, dtype=np.int64)
        if rows <= _HEAD_ROWS:
            return head
        steps = math.ceil(math.log(rows / _HEAD_ROWS) / math.log1p(_BIN_GROWTH)) + 1
        # Strictly increasing (each step adds >= head * growth = 16 rows) until clipped.
        tail = np.floor(_HEAD_ROWS * (1 + _BIN_GROWTH) ** np.arange(1, steps + 1)).astype(np.int64)
        return np.concatenate([head, tail[tail < rows], [rows]])

    @classmethod
    def power_law(cls, rows: int, alpha: float) -> BinnedProfile:
        """p ∝ (rank + 1)^-alpha; tail bins integrate x^-alpha over [lo + 1/2, hi + 1/2]."""
        edges = cls._edges(rows)
        head = edges[edges <= _HEAD_ROWS][1:].astype(np.float64)  # 1-based ranks 1..head
        lo, hi = edges[len(head) : -1] + 0.5, edges[len(head) + 1 :] + 0.5
        mass_head = head**-alpha
        beta = 1.0 - alpha
        log_lo, log_ratio = np.log(lo), np.log(hi / lo)
        if abs(beta) < 1e-12:
            mass_tail = log_ratio
        else:  # lo^beta · (exp(beta · ln(hi/lo)) - 1) / beta, stable near alpha = 1
            mass_tail = np.exp(beta * log_lo) * np.expm1(beta * log_ratio) / beta
        counts = np.diff(edges).astype(np.float64)
        mass = np.concatenate([mass_head, mass_tail])
        return cls(counts, mass / mass.sum() / counts)

    @classmethod
    def from_probabilities(cls, probabilities: np.ndarray) -> BinnedProfile:
        """From per-row probabilities sorted in decreasing order (an `AccessProfile`'s)."""
        p = np.asarray(probabilities, dtype=np.float64)
        edges = cls._edges(p.size)
        counts = np.diff(edges).astype(np.float64)
        return cls(counts, np.add.reduceat(p, edges[:-1]) / counts)

    def _touch(self, n: float) -> np.ndarray:
        """q = 1 - (1 - p)^n per bin: the chance a batch of n lookups touches one row."""
        key = ("q", float(n))
        if key not in self._memo:
            self._memo[key] = -np.expm1(n * np.log1p(-np.minimum(self.probability, 1 - 1e-16)))
        return self._memo[key]

    def unique(self, n: float) -> float:
        """Expected distinct rows in n lookups (`stats.expected_unique`)."""
        key = ("u", float(n))
        if key not in self._memo:
            self._memo[key] = float(self.rows_per_bin @ self._touch(n))
        return self._memo[key]

    def loads(self, n: float, capacity: int, model: str = "frequency") -> float:
        """Expected rows loaded per batch into a cache of `capacity` rows
        (`stats.expected_loads`)."""
        key = ("l", float(n), int(capacity), model)
        if key in self._memo:
            return self._memo[key]
        if capacity >= self.rows:
            value = 0.0
        elif model == "frequency":
            q = self._touch(n)
            k = int(np.searchsorted(self.rows_through, capacity, side="right"))
            rest = self.rows_per_bin[k + 1 :] @ q[k + 1 :]
            value = float((self.rows_through[k] - capacity) * q[k] + rest)
        elif model == "lru":
            value = self._lru_loads(self._touch(n), capacity)
        else:
            raise ValueError(f"unknown model {model!r}: expected 'frequency' or 'lru'")
        self._memo[key] = value
        return value

    def _lru_loads(self, q: np.ndarray, capacity: int) -> float:
        """Che's approximation: τ with Σ rows·(1 - (1-q)^τ) = capacity; misses q·(1-q)^τ."""
        log_keep = np.log1p(-np.minimum(q, 1 - 1e-16))

        def resident(tau: float) -> float:
            return float(self.rows_per_bin @ -np.expm1(tau * log_keep))

        lo, hi = 0.0, 1.0
        while resident(hi) < capacity:
            lo, hi = hi, hi * 2
            if hi > 1e15:
                return 0.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if resident(mid) < capacity else (lo, mid)
            if hi - lo <= 1e-9 * hi:
                break
        return float(self.rows_per_bin @ (q * np.exp(0.5 * (lo + hi) * log_keep)))


_PROFILES: dict[tuple, tuple[object, BinnedProfile]] = {}
_PROFILE_CACHE_SIZE = 4096


def table_access(table: TableStats) -> BinnedProfile:
    """The binned access profile of `table`, built once per (rows, alpha) or counts array."""
    if table.counts is None:
        key: tuple = ("power_law", table.rows, float(table.alpha))
    else:  # the cache holds the array, so its id cannot be reused while the entry lives
        key = ("counts", table.rows, id(table.counts))
    if key not in _PROFILES:
        if len(_PROFILES) >= _PROFILE_CACHE_SIZE:
            _PROFILES.clear()
        if table.counts is None:
            profile = BinnedProfile.power_law(table.rows, float(table.alpha))
        else:
            exact = AccessProfile.from_counts(table.counts, rows=table.rows)
            profile = BinnedProfile.from_probabilities(exact.probabilities)
        _PROFILES[key] = (table.counts, profile)
    return _PROFILES[key][1]


# ---------------------------------------------------------------------------------------------
# Per-shard terms
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ShardTerms:
    """The modelled work and memory of one shard of a table on its rank, per step."""

    shard_rows: int
    shard_dim: int
    row_bytes: int
    """Bytes of one stored row of the shard, optimizer state included."""
    ids_per_step: float
    unique_rows_per_step: float
    lookup_s: float
    cache_rows: int
    """Rows of the device cache (the shard's rows for device storage)."""
    working_set_rows: float
    """Rows the K + 1 batches in flight touch; the cache must hold them (0 for device)."""
    loads_per_step: float
    staging_bytes_per_step: float
    staging_s: float
    staging_overlapped: bool
    """Staging runs beside compute: look-ahead with K > 0 on a GPU (on CPU it never does)."""
    device_memory_bytes: int
    host_memory_bytes: int
    ids_bytes_per_peer: float
    """Input all-to-all: bytes each consumer rank sends this shard."""
    embedding_bytes_per_peer: float
    """Output all-to-all: bytes this shard sends each consumer rank (forward; backward same)."""
    all_reduce_bytes: float
    """Gradient bytes all-reduced each step (data parallel only)."""

    @property
    def fits_working_set(self) -> bool:
        return self.cache_rows >= math.ceil(self.working_set_rows - 1e-9)


def lookup_time_s(
    *, ids: float, unique_rows: float, dim_bytes: int, row_bytes: int, topology: Topology
) -> float:
    """Forward + backward of an embedding-bag shard (see the module docstring).

    Args:
        ids: lookups served per step.
        unique_rows: rows updated per step.
        dim_bytes: bytes of the embedding part of a row (what the forward reads).
        row_bytes: bytes of a stored row with its optimizer state (what the update touches).
        topology: gives the device memory bandwidth or measured `lookup_rows_per_s`.
    """
    if topology.lookup_rows_per_s:
        seconds = (2 * ids + 2 * unique_rows) / topology.lookup_rows_per_s
        if topology.lookup_bytes_per_s:
            traffic = 2 * ids * dim_bytes + 2 * unique_rows * row_bytes
            seconds += traffic / topology.lookup_bytes_per_s
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


def staging_time_s(staging_bytes: float, topology: Topology, cache_rows: int = 0) -> float:
    """Host-device time of a cache's traffic per step: one load and one write-back transfer,
    and, where the topology measures it, the victim choice scoring the cache's `cache_rows`
    slots."""
    if staging_bytes <= 0:
        return 0.0
    scan = cache_rows / topology.cache_scan_rows_per_s if topology.cache_scan_rows_per_s else 0.0
    return (
        staging_bytes / topology.host_to_device_bw_bytes_per_s
        + 2 * topology.host_to_device_latency_s
        + scan
    )


def shard_access(
    table: TableStats, workload: Workload, topology: Topology, *, sharding: str, shards: int
) -> tuple[int, float, float]:
    """(rows, ids served, distinct rows touched) per step of one shard of `table`; for data
    parallel the distinct rows are all rows (a dense gradient updates every row)."""
    per_rank_ids = workload.batch_size_per_rank * table.pooling_factor
    global_ids = per_rank_ids * topology.world_size
    if sharding == DATA_PARALLEL:
        return table.rows, per_rank_ids, float(table.rows)
    unique = table_access(table).unique(global_ids)
    if sharding == ROW_WISE:
        return -(-table.rows // shards), global_ids / shards, unique / shards
    return table.rows, global_ids, unique


def shard_terms(
    table: TableStats,
    workload: Workload,
    topology: Topology,
    *,
    sharding: str,
    shards: int,
    storage: str = DEVICE,
    cache_fraction: float = 1.0,
    lookahead: int = 0,
    prefetch_depth: int = 0,
) -> ShardTerms:
    """The terms of one shard of `table` placed as described (see the module docstring).

    Args:
        table: the table.
        workload: batch size, optimizer and dtype.
        topology: rates and world size.
        sharding: one of `types.SHARDING_TYPES`.
        shards: number of shards (ranks) of the table; ignored for data parallel.
        storage, cache_fraction, lookahead, prefetch_depth: as in `TablePlan`.
    """
    dtype = workload.dtype_bytes
    per_rank_ids = workload.batch_size_per_rank * table.pooling_factor
    global_ids = per_rank_ids * topology.world_size
    access = table_access(table)
    split = shards if sharding in (ROW_WISE, COLUMN_WISE) else 1
    dim = table.dim // split if sharding == COLUMN_WISE else table.dim
    row_bytes = (dim + OPTIMIZER_STATE[workload.optimizer](dim)) * dtype
    rows, ids, unique = shard_access(table, workload, topology, sharding=sharding, shards=shards)
    sharded = sharding != DATA_PARALLEL
    lookup_s = lookup_time_s(
        ids=ids,
        unique_rows=unique if sharded else 0.0,  # data parallel: a dense update instead
        dim_bytes=dim * dtype,
        row_bytes=row_bytes,
        topology=topology,
    )
    if sharded:
        lookup_s += topology.id_overhead_s * ids  # routing the ids this shard serves
    else:
        lookup_s += dense_update_time_s(rows * row_bytes, topology)
    cached = storage == HOST_CACHED
    cache_rows = min(rows, math.ceil(cache_fraction * rows)) if cached else rows
    loads = 0.0
    if cached:
        model = "frequency" if lookahead > 0 else "lru"
        scale = split if sharding == ROW_WISE else 1  # row-wise: the table's cache is S shards'
        loads = access.loads(global_ids, cache_rows * scale, model) / scale
    staging_bytes = 2 * loads * row_bytes
    index_bytes = (
        CACHE_ROW_INDEX_BYTES_LOOKAHEAD if lookahead > 0 else CACHE_ROW_INDEX_BYTES_REACTIVE
    )
    device_bytes = (
        cache_rows * (row_bytes + CACHE_SLOT_BYTES) + rows * index_bytes
        if cached
        else rows * row_bytes
    )
    return ShardTerms(
        shard_rows=rows,
        shard_dim=dim,
        row_bytes=row_bytes,
        ids_per_step=ids,
        unique_rows_per_step=unique,
        lookup_s=lookup_s,
        cache_rows=cache_rows,
        working_set_rows=(prefetch_depth + 1) * unique if cached else 0.0,
        loads_per_step=loads,
        staging_bytes_per_step=staging_bytes,
        # Look-ahead victims are scored over every slot; LRU's one subtraction is not priced.
        staging_s=staging_time_s(staging_bytes, topology, cache_rows if lookahead > 0 else 0),
        staging_overlapped=lookahead > 0
        and prefetch_depth > 0
        and topology.compute_device == "cuda",
        device_memory_bytes=int(device_bytes),
        host_memory_bytes=rows * row_bytes if cached else 0,
        ids_bytes_per_peer=per_rank_ids * ID_BYTES / (split if sharding == ROW_WISE else 1)
        if sharded
        else 0.0,
        embedding_bytes_per_peer=workload.batch_size_per_rank * dim * dtype if sharded else 0.0,
        all_reduce_bytes=0.0 if sharded else table.rows * table.dim * dtype,
    )


def table_plan_terms(
    table_plan: TablePlan, table: TableStats, workload: Workload, topology: Topology
) -> ShardTerms:
    """`shard_terms` of the shards of `table_plan` (every shard of a table is alike)."""
    return shard_terms(
        table,
        workload,
        topology,
        sharding=table_plan.sharding,
        shards=len(table_plan.ranks),
        storage=table_plan.storage,
        cache_fraction=table_plan.cache_fraction,
        lookahead=table_plan.lookahead,
        prefetch_depth=table_plan.prefetch_depth,
    )


# ---------------------------------------------------------------------------------------------
# Dense terms and collectives
# ---------------------------------------------------------------------------------------------


def _mlp(in_features: int, layers: tuple[int, ...]) -> tuple[float, float]:
    """(forward flops per sample, parameters) of an MLP."""
    flops = params = 0.0
    for out in layers:
        flops += 2.0 * in_features * out
        params += in_features * out + out
        in_features = out
    return flops, params


def dense_flops_per_sample(workload: Workload) -> float:
    """Forward flops of DLRM's dense part per sample: bottom MLP, dot interaction of the
    F = tables + 1 vectors, top MLP over the dense vector and the F(F-1)/2 dot products."""
    features = len(workload.tables) + 1
    width = workload.bottom_mlp[-1] if workload.bottom_mlp else workload.dense_in_features
    bottom, _ = _mlp(workload.dense_in_features, workload.bottom_mlp)
    top, _ = _mlp(width + features * (features - 1) // 2, workload.top_mlp)
    return bottom + 2.0 * features * features * width + top


def dense_parameter_bytes(workload: Workload) -> float:
    """Bytes of the MLPs' parameters (= their gradient, all-reduced every step)."""
    features = len(workload.tables) + 1
    width = workload.bottom_mlp[-1] if workload.bottom_mlp else workload.dense_in_features
    _, bottom = _mlp(workload.dense_in_features, workload.bottom_mlp)
    _, top = _mlp(width + features * (features - 1) // 2, workload.top_mlp)
    return (bottom + top) * workload.dtype_bytes


def dense_layers(workload: Workload) -> list[tuple[int, int]]:
    """(inputs, outputs) per sample of each dense layer: the MLPs' and the interaction's."""
    features = len(workload.tables) + 1
    width = workload.bottom_mlp[-1] if workload.bottom_mlp else workload.dense_in_features
    layers, inputs = [], workload.dense_in_features
    for out in workload.bottom_mlp:
        layers.append((inputs, out))
        inputs = out
    pairs = features * (features - 1) // 2
    layers.append((features * width, pairs))
    inputs = width + pairs
    for out in workload.top_mlp:
        layers.append((inputs, out))
        inputs = out
    return layers


def dense_compute_s(workload: Workload, topology: Topology) -> float:
    """Forward + backward (3x forward) of the dense part over the rank's batch, with the
    layers' fixed cost and activation traffic where the topology measures them."""
    batch = workload.batch_size_per_rank
    seconds = 3 * dense_flops_per_sample(workload) * batch / topology.dense_flops_per_s
    layers = dense_layers(workload)
    seconds += len(layers) * topology.dense_layer_overhead_s
    if topology.dense_activation_bytes_per_s:
        elements = sum(ACTIVATION_IN_PASSES * i + ACTIVATION_OUT_PASSES * o for i, o in layers)
        seconds += batch * elements * workload.dtype_bytes / topology.dense_activation_bytes_per_s
    return seconds


def all_reduce_s(num_bytes: float, topology: Topology) -> float:
    """Hierarchical all-reduce of `num_bytes` over every rank (0 on one rank)."""
    if topology.world_size == 1 or num_bytes <= 0:
        return 0.0
    per_node = min(topology.ranks_per_node, topology.world_size)
    nodes = topology.num_nodes
    intra = 2 * (per_node - 1) / per_node * num_bytes / topology.intra_node_bw_bytes_per_s
    inter = 2 * (nodes - 1) / nodes * num_bytes / per_node / topology.inter_node_bw_bytes_per_s
    return intra + inter + sync_latency_s(topology)


def sync_latency_s(topology: Topology) -> float:
    """Latency of a collective the ranks enter from their own computation (outputs,
    all-reduces): `Topology.sync_latency_s`, at least the network's."""
    return max(topology.network_latency_s, topology.sync_latency_s or 0.0)


# ---------------------------------------------------------------------------------------------
# Per-rank accumulation: a [TERMS, W] array per plan, shared with the solver
# ---------------------------------------------------------------------------------------------

RANK_TERMS = (
    "lookup_s",
    "overlapped_staging_s",
    "exposed_staging_s",
    "ids_sent_intra_bytes",
    "ids_sent_inter_bytes",
    "ids_received_intra_bytes",
    "ids_received_inter_bytes",
    "emb_sent_intra_bytes",
    "emb_sent_inter_bytes",
    "emb_received_intra_bytes",
    "emb_received_inter_bytes",
    "device_memory_bytes",
    "host_memory_bytes",
)
(LOOKUP, OVERLAPPED, EXPOSED, IDS_SI, IDS_SE, IDS_RI, IDS_RE) = range(7)
(EMB_SI, EMB_SE, EMB_RI, EMB_RE, DEVICE_MEMORY, HOST_MEMORY) = range(7, 13)


@functools.lru_cache(maxsize=64)
def node_layout(topology: Topology) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(node of each rank [W], first rank of each node [N], ranks of each rank's node [W])."""
    ranks = np.arange(topology.world_size)
    node = ranks // topology.ranks_per_node
    starts = np.arange(0, topology.world_size, topology.ranks_per_node)
    sizes = np.diff(np.append(starts, topology.world_size))
    return node, starts, sizes[node].astype(np.float64)


def peer_counts(is_owner: np.ndarray, topology: Topology) -> tuple[np.ndarray, ...]:
    """Peers each rank exchanges with for a table whose shards sit where `is_owner` is 1.

    Args:
        is_owner: [..., W] 0/1.

    Returns:
        (owners on my node but not me, owners on other nodes, consumers on my node if I own a
        shard, consumers on other nodes if I own one), each [..., W].
    """
    node, starts, node_size = node_layout(topology)
    on_node = np.add.reduceat(is_owner, starts, axis=-1)[..., node]  # [..., W]
    shards = is_owner.sum(axis=-1, keepdims=True)
    return (
        on_node - is_owner,
        shards - on_node,
        is_owner * (node_size - 1),
        is_owner * (topology.world_size - node_size),
    )


def shard_contribution(terms: ShardTerms, ranks: tuple[int, ...], topology: Topology) -> np.ndarray:
    """The [TERMS, W] rank terms of a table whose identical shards sit on `ranks`."""
    load = np.zeros((len(RANK_TERMS), topology.world_size))
    owners = list(ranks)
    load[LOOKUP, owners] = terms.lookup_s
    load[OVERLAPPED if terms.staging_overlapped else EXPOSED, owners] = terms.staging_s
    load[DEVICE_MEMORY, owners] = terms.device_memory_bytes
    load[HOST_MEMORY, owners] = terms.host_memory_bytes
    ids, emb = terms.ids_bytes_per_peer, terms.embedding_bytes_per_peer
    if ids or emb:
        is_owner = np.zeros(topology.world_size)
        is_owner[owners] = 1.0
        counts = np.stack(peer_counts(is_owner, topology))  # [4, W]: mine, theirs, local, remote
        load[IDS_SI : IDS_RE + 1] = ids * counts
        load[EMB_SI : EMB_RE + 1] = emb * counts[[2, 3, 0, 1]]
    return load


def a2a_time_s(
    sent_intra: np.ndarray,
    sent_inter: np.ndarray,
    received_intra: np.ndarray,
    received_inter: np.ndarray,
    topology: Topology,
) -> np.ndarray:
    """One all-to-all's time per rank from its bytes (elementwise), without latency: links
    are full duplex and NVLink and the NIC run at once, so the slowest of the four sets it."""
    intra = np.maximum(sent_intra, received_intra) / topology.intra_node_bw_bytes_per_s
    inter = np.maximum(sent_inter, received_inter) / topology.inter_node_bw_bytes_per_s
    return np.maximum(intra, inter)


def a2a_pair_s(load: np.ndarray, first: int, topology: Topology) -> np.ndarray:
    """`a2a_time_s` of the four byte rows of `load` [..., TERMS, W] starting at `first`."""
    rows = [load[..., first + i, :] for i in range(4)]
    return a2a_time_s(*rows, topology)


def rank_totals(
    load: np.ndarray, *, dense_s: float, global_s: float, latency_s: float, topology: Topology
) -> np.ndarray:
    """Step time per rank from accumulated rank terms.

    Args:
        load: [..., TERMS, W] accumulated `shard_contribution`s.
        dense_s: dense compute per step.
        global_s: terms every rank pays alike (`GlobalTerms.shared_s`).
        latency_s: all-to-all latencies per step not in `global_s`.
        topology: the link rates.

    Returns:
        [..., W] seconds.
    """
    compute = dense_s + load[..., LOOKUP, :]
    exposed = np.maximum(load[..., OVERLAPPED, :] - compute, 0.0) + load[..., EXPOSED, :]
    a2a = a2a_pair_s(load, IDS_SI, topology) + 2 * a2a_pair_s(load, EMB_SI, topology)
    return compute + exposed + a2a + latency_s + global_s


# ---------------------------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------------------------


def validate_plan(plan: Plan, workload: Workload, topology: Topology) -> None:
    """Raise `DistcacheConfigError` unless `plan` places every table of `workload` exactly
    once on valid ranks of `topology` (column-wise shards must divide the dim)."""
    counts = Counter(t.table for t in plan.tables)
    known = {t.name: t for t in workload.tables}
    duplicate = sorted(n for n, k in counts.items() if k > 1)
    unknown = sorted(set(counts) - set(known))
    missing = [n for n in known if n not in counts]
    for problem, found in (
        ("planned twice", duplicate),
        ("unknown", unknown),
        ("unplanned", missing),
    ):
        if found:
            raise DistcacheConfigError(
                f"plan {plan.name!r} does not match workload {workload.name!r}: tables {problem}: "
                f"{found[:10]}{' ...' if len(found) > 10 else ''}"
            )
    world = topology.world_size
    for tp in plan.tables:
        bad = [r for r in tp.ranks if not 0 <= r < world]
        if bad:
            raise DistcacheConfigError(
                f"table {tp.table!r}: ranks {bad} are outside the world of {world} ranks"
            )
        if len(set(tp.ranks)) != len(tp.ranks):
            raise DistcacheConfigError(f"table {tp.table!r}: ranks {tp.ranks} repeat a rank")
        if tp.sharding == DATA_PARALLEL and len(tp.ranks) != world:
            raise DistcacheConfigError(
                f"table {tp.table!r}: data parallel runs on all {world} ranks, got {tp.ranks}"
            )
        dim = known[tp.table].dim
        if tp.sharding == COLUMN_WISE and dim % len(tp.ranks):
            raise DistcacheConfigError(
                f"table {tp.table!r}: column-wise over {len(tp.ranks)} ranks needs a dim divisible "
                f"by {len(tp.ranks)}, got dim {dim}"
            )


@dataclass(frozen=True)
class GlobalTerms:
    """What every rank pays alike, per step."""

    all_reduce_s: float
    input_latency_s: float
    """Latencies of the input all-to-alls, 3 per sharding type (data parallel aside)."""
    output_latency_s: float
    """Sync latencies of the output all-to-alls, forward and backward, 2 per sharding type."""
    overhead_s: float
    """`Topology.step_overhead_s` + `sharding_overhead_s` per sharding type used."""

    @property
    def shared_s(self) -> float:
        return self.all_reduce_s + self.input_latency_s + self.output_latency_s + self.overhead_s


def global_terms(
    workload: Workload,
    topology: Topology,
    dp_bytes: float,
    shardings: Collection[str],
    sent_ids: float = 0.0,
) -> GlobalTerms:
    """The shared terms of a plan with `dp_bytes` of data-parallel gradients whose tables use
    the sharding types `shardings` (the set of `TablePlan.sharding`s), each rank sending
    `sent_ids` ids per step (`sent_ids_per_rank`)."""
    kinds = set(shardings)
    routed = len(kinds - {DATA_PARALLEL}) if topology.world_size > 1 else 0
    all_reduce = all_reduce_s(dense_parameter_bytes(workload) + dp_bytes, topology)
    if dp_bytes > 0 and topology.world_size > 1:
        all_reduce += sync_latency_s(topology)  # the data-parallel tables' own all-reduce
    return GlobalTerms(
        all_reduce_s=all_reduce,
        input_latency_s=INPUT_COLLECTIVES * topology.network_latency_s * routed,
        output_latency_s=OUTPUT_COLLECTIVES * sync_latency_s(topology) * routed,
        overhead_s=topology.step_overhead_s
        + topology.sharding_overhead_s * len(kinds)
        + topology.id_overhead_s * sent_ids,
    )


def sent_ids_per_rank(terms: ShardTerms, shards: int) -> float:
    """Ids each rank sends a table of `shards` shards per step (column-wise: to every shard;
    row-wise: each id to one); 0 for data parallel."""
    return terms.ids_bytes_per_peer / ID_BYTES * shards


def plan_cost(plan: Plan, workload: Workload, topology: Topology) -> PlanCost:
    """The modelled step time per rank and memory of `plan` (see the module docstring).

    Any valid plan is priced, whoever made it: a TorchRec plan's UVM-cached tables are
    host_cached tables with lookahead 0 (a reactive LRU cache on the critical path).

    Args:
        plan: a placement of every table of `workload`.
        workload: the model and batch.
        topology: the hardware.

    Example::

        cost = plan_cost(solve(workload, topology), workload, topology)
        assert cost.fits
    """
    validate_plan(plan, workload, topology)
    tables = {t.name: t for t in workload.tables}
    load = np.zeros((len(RANK_TERMS), topology.world_size))
    dp_bytes, sent, violations = 0.0, 0.0, []
    for tp in plan.tables:
        terms = table_plan_terms(tp, tables[tp.table], workload, topology)
        load += shard_contribution(terms, tp.ranks, topology)
        dp_bytes += terms.all_reduce_bytes
        sent += sent_ids_per_rank(terms, len(tp.ranks))
        if not terms.fits_working_set:
            violations.append(
                f"table {tp.table!r}: cache of {terms.cache_rows} rows per shard is smaller than "
                f"the {math.ceil(terms.working_set_rows)} rows its {tp.prefetch_depth + 1} "
                "batches in flight touch"
            )
    kinds = {tp.sharding for tp in plan.tables}
    shared = global_terms(workload, topology, dp_bytes, kinds, sent)
    dense = dense_compute_s(workload, topology)
    for kind, row, limit in (
        ("device", DEVICE_MEMORY, topology.device_memory_bytes),
        ("host", HOST_MEMORY, topology.host_memory_bytes),
    ):
        for rank in np.flatnonzero(load[row] > limit):
            violations.append(
                f"rank {rank}: {kind} memory {load[row, rank] / 1e9:.2f} GB > {limit / 1e9:.2f} GB"
            )
    return PlanCost(
        per_rank=_step_costs(load, dense, shared, topology),
        device_memory_bytes=tuple(int(b) for b in load[DEVICE_MEMORY]),
        host_memory_bytes=tuple(int(b) for b in load[HOST_MEMORY]),
        global_batch_size=workload.batch_size_per_rank * topology.world_size,
        fits=not violations,
        violations=tuple(violations),
    )


def _step_costs(
    load: np.ndarray, dense_s: float, shared: GlobalTerms, topology: Topology
) -> tuple[StepCost, ...]:
    compute = dense_s + load[LOOKUP]
    exposed = np.maximum(load[OVERLAPPED] - compute, 0.0) + load[EXPOSED]
    ids = a2a_pair_s(load, IDS_SI, topology) + shared.input_latency_s
    emb = 2 * a2a_pair_s(load, EMB_SI, topology) + shared.output_latency_s
    return tuple(
        StepCost(
            dense_compute_s=dense_s,
            lookup_s=float(load[LOOKUP, r]),
            staging_s=float(load[OVERLAPPED, r] + load[EXPOSED, r]),
            exposed_staging_s=float(exposed[r]),
            input_all_to_all_s=float(ids[r]),
            output_all_to_all_s=float(emb[r]),
            all_reduce_s=shared.all_reduce_s,
            overhead_s=shared.overhead_s,
        )
        for r in range(topology.world_size)
    )
