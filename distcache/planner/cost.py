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
  `lookup_rows_per_s` set: (2·n + 2·U) / lookup_rows_per_s. Data-parallel tables get a dense
  gradient, so their update touches all R rows (U = R).
- staging (host-cached shards) = 2·loads·r / host-device bandwidth + 2 transfer latencies:
  loads per step from `expected_loads` — 'frequency' with look-ahead (L > 0), 'lru' without —
  and as many write-backs (nearly every victim was trained). With L > 0 and K > 0 it overlaps
  the rank's compute (dense + lookup): exposed = max(0, staging - compute); else fully exposed.
  The cache must hold the rows of the K + 1 batches in flight: cache rows >= (K + 1)·U.
- all-to-all: each consumer rank sends B·P·8 bytes of ids to each shard (row-wise: /S) and each
  shard sends B·D_shard·dtype bytes of pooled embeddings (row-wise: partial sums, D) to each
  consumer; backward sends the gradients back the same way. A rank's time per collective is
  max(max(sent, received) over NVLink / intra bandwidth, same over the NIC / inter bandwidth)
  plus one network latency: links are full duplex and both kinds run at once.
- all-reduce (dense MLP parameters + data-parallel tables' gradients, X bytes), hierarchical:
  2·(k-1)/k·X / intra + 2·(N-1)/N·X/k / inter for N nodes of k ranks, plus a latency.
- dense compute = 3 · DLRM forward flops per sample · B / dense_flops_per_s.
- step (per rank) = dense + lookup + exposed staging + all-to-alls + all-reduce; the plan's
  step is the slowest rank's.
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
CACHE_ROW_INDEX_BYTES_LOOKAHEAD = 32  # per shard row: slot map + look-ahead record (4 x int64)
CACHE_ROW_INDEX_BYTES_REACTIVE = 8  # per shard row: slot map (int64), LRU policy
CACHE_SLOT_BYTES = 40  # per slot: row map, stamp, next use, count (int64), dirty, pin
ACCESS_BYTES = 32  # granularity of random memory access (a GPU DRAM sector)

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
        return (2 * ids + 2 * unique_rows) / topology.lookup_rows_per_s
    read, update = _sectors(dim_bytes), _sectors(row_bytes)
    return (2 * ids * read + 2 * unique_rows * update) / topology.device_memory_bw_bytes_per_s


def _sectors(num_bytes: int) -> int:
    """Bytes a random row access moves: whole `ACCESS_BYTES` sectors (a narrow column-wise
    shard does not read less than one sector per row)."""
    return -(-num_bytes // ACCESS_BYTES) * ACCESS_BYTES


def staging_time_s(staging_bytes: float, topology: Topology) -> float:
    """Host-device time of a cache's traffic per step: one load and one write-back transfer."""
    if staging_bytes <= 0:
        return 0.0
    return (
        staging_bytes / topology.host_to_device_bw_bytes_per_s
        + 2 * topology.host_to_device_latency_s
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
    lookup_s = lookup_time_s(
        ids=ids, unique_rows=unique, dim_bytes=dim * dtype, row_bytes=row_bytes, topology=topology
    )
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
    sharded = sharding != DATA_PARALLEL
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
        staging_s=staging_time_s(staging_bytes, topology),
        staging_overlapped=lookahead > 0 and prefetch_depth > 0,
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


def dense_compute_s(workload: Workload, topology: Topology) -> float:
    """Forward + backward (3x forward) of the dense part over the rank's batch."""
    flops = 3 * dense_flops_per_sample(workload) * workload.batch_size_per_rank
    return flops / topology.dense_flops_per_s


def all_reduce_s(num_bytes: float, topology: Topology) -> float:
    """Hierarchical all-reduce of `num_bytes` over every rank (0 on one rank)."""
    if topology.world_size == 1 or num_bytes <= 0:
        return 0.0
    per_node = min(topology.ranks_per_node, topology.world_size)
    nodes = topology.num_nodes
    intra = 2 * (per_node - 1) / per_node * num_bytes / topology.intra_node_bw_bytes_per_s
    inter = 2 * (nodes - 1) / nodes * num_bytes / per_node / topology.inter_node_bw_bytes_per_s
    return intra + inter + topology.network_latency_s


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
        global_s: terms every rank pays alike (all-reduce).
        latency_s: latency of one all-to-all (0 when no table is sharded).
        topology: the link rates.

    Returns:
        [..., W] seconds.
    """
    compute = dense_s + load[..., LOOKUP, :]
    exposed = np.maximum(load[..., OVERLAPPED, :] - compute, 0.0) + load[..., EXPOSED, :]
    a2a = a2a_pair_s(load, IDS_SI, topology) + 2 * a2a_pair_s(load, EMB_SI, topology)
    return compute + exposed + a2a + 3 * latency_s + global_s


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


def global_terms(
    workload: Workload, topology: Topology, dp_bytes: float, sharded: bool
) -> tuple[float, float]:
    """(all-reduce seconds, all-to-all latency) of a plan with `dp_bytes` of data-parallel
    gradients and, if `sharded`, at least one sharded table."""
    latency = topology.network_latency_s if sharded and topology.world_size > 1 else 0.0
    return all_reduce_s(dense_parameter_bytes(workload) + dp_bytes, topology), latency


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
    dp_bytes, sharded, violations = 0.0, False, []
    for tp in plan.tables:
        terms = table_plan_terms(tp, tables[tp.table], workload, topology)
        load += shard_contribution(terms, tp.ranks, topology)
        dp_bytes += terms.all_reduce_bytes
        sharded = sharded or tp.sharding != DATA_PARALLEL
        if not terms.fits_working_set:
            violations.append(
                f"table {tp.table!r}: cache of {terms.cache_rows} rows per shard is smaller than "
                f"the {math.ceil(terms.working_set_rows)} rows its {tp.prefetch_depth + 1} "
                "batches in flight touch"
            )
    all_reduce, latency = global_terms(workload, topology, dp_bytes, sharded)
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
        per_rank=_step_costs(load, dense, all_reduce, latency, topology),
        device_memory_bytes=tuple(int(b) for b in load[DEVICE_MEMORY]),
        host_memory_bytes=tuple(int(b) for b in load[HOST_MEMORY]),
        global_batch_size=workload.batch_size_per_rank * topology.world_size,
        fits=not violations,
        violations=tuple(violations),
    )


def _step_costs(
    load: np.ndarray, dense_s: float, all_reduce: float, latency: float, topology: Topology
) -> tuple[StepCost, ...]:
    compute = dense_s + load[LOOKUP]
    exposed = np.maximum(load[OVERLAPPED] - compute, 0.0) + load[EXPOSED]
    ids = a2a_pair_s(load, IDS_SI, topology) + latency
    emb = 2 * (a2a_pair_s(load, EMB_SI, topology) + latency)
    return tuple(
        StepCost(
            dense_compute_s=dense_s,
            lookup_s=float(load[LOOKUP, r]),
            staging_s=float(load[OVERLAPPED, r] + load[EXPOSED, r]),
            exposed_staging_s=float(exposed[r]),
            input_all_to_all_s=float(ids[r]),
            output_all_to_all_s=float(emb[r]),
            all_reduce_s=all_reduce,
        )
        for r in range(topology.world_size)
    )
