"""The planner's vocabulary: what is planned (a `Workload`), on what (a `Topology`), the result (a
`Plan`), its modelled cost (`PlanCost`) and what the solver may choose from (`SolverOptions`, here
so that the solver's stages depend on these types, not on the solver). Plain frozen dataclasses,
units in field names.

Every planning stage — statistics (`stats.py`), cost model (`cost.py`), solver (`solver.py`),
export to TorchRec (`torchrec/export.py`), comparison (`distcache/tools/compare.py`) — speaks
these types only, so a plan from any source (distcache's solver, TorchRec's planner, a JSON
file) is priced the same way. Like every module of the planner's core, this one imports no
TorchRec (tests/unit/planner/test_core_imports.py).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from distcache.constants import DEFAULT_LOOKAHEAD, HOT_ALL, HOT_REDUCE
from distcache.errors import DistcacheConfigError, UnknownTableError
from distcache.planner.stats import AccessProfile

DATA_PARALLEL = "data_parallel"
TABLE_WISE = "table_wise"
ROW_WISE = "row_wise"
COLUMN_WISE = "column_wise"
TABLE_ROW_WISE = "table_row_wise"
"""Row-wise within one node (TorchRec's `table_row_wise`), or column blocks each row-wise within
its own node (TorchRec's `grid_shard`): partial sums reduce-scattered inside the node, then one
all-to-all across nodes. The ranks are whole nodes."""
SHARDING_TYPES = (DATA_PARALLEL, TABLE_WISE, ROW_WISE, COLUMN_WISE, TABLE_ROW_WISE)
SOLVER_SHARDINGS = (DATA_PARALLEL, TABLE_WISE, ROW_WISE, COLUMN_WISE, TABLE_ROW_WISE)
"""The sharding types distcache's solver chooses among; plans from elsewhere (TorchRec's
planner) may also use `TABLE_ROW_WISE`, which the cost model prices as TorchRec runs it."""

DEVICE = "device"  # every row of the shard in device memory
HOST_CACHED = "host_cached"  # rows in host memory, a look-ahead cache of some rows on the device
STORAGES = (DEVICE, HOST_CACHED)

# Optimizer state per row, in elements of the row's dtype: f(dim).
OPTIMIZER_STATE = {
    "sgd": lambda dim: 0,
    "rowwise_adagrad": lambda dim: 1,
    "adagrad": lambda dim: dim,
    "adam": lambda dim: 2 * dim,
}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise DistcacheConfigError(message)


@dataclass(frozen=True, kw_only=True)
class TableStats:
    """One embedding table as the planner sees it."""

    name: str
    rows: int
    dim: int
    pooling_factor: float = 1.0
    """Ids per sample of each feature reading this table, summed over its features."""
    alpha: float | None = 1.05
    """Power-law exponent of the access profile (p_r ∝ (r + 1)^-alpha); None with `counts`."""
    counts: np.ndarray | None = field(default=None, repr=False, compare=False)
    """Id counts from a data sample (overrides `alpha`)."""
    row_dtype_bytes: int | None = None
    """Bytes per element of the table's rows (2 for fp16 / bf16 tables); None: the workload's
    `dtype_bytes`. The optimizer state and the pooled embeddings keep the workload's."""
    pooled: bool = True
    """True for a table of an `EmbeddingBagCollection` (one pooled row a bag); False for one of
    an `EmbeddingCollection` (a sequence table: one output row per id, which the output
    all-to-all sends per id, and which TorchRec shards data-parallel, table-, column- or
    row-wise only)."""

    def __post_init__(self) -> None:
        _check(self.rows >= 1, f"table {self.name!r}: rows must be >= 1, got {self.rows}")
        _check(self.dim >= 1, f"table {self.name!r}: dim must be >= 1, got {self.dim}")
        _check(
            self.pooling_factor > 0,
            f"table {self.name!r}: pooling_factor must be > 0, got {self.pooling_factor}",
        )
        _check(
            self.counts is not None or (self.alpha is not None and self.alpha >= 0),
            f"table {self.name!r}: give alpha >= 0 or counts",
        )
        _check(
            isinstance(self.pooled, bool),
            f"table {self.name!r}: pooled must be true or false, got {self.pooled!r}",
        )
        _check(
            self.row_dtype_bytes in (None, 1, 2, 4, 8),
            f"table {self.name!r}: row_dtype_bytes must be None, 1, 2, 4 or 8, got "
            f"{self.row_dtype_bytes}",
        )

    def profile(self) -> AccessProfile:
        if self.counts is not None:
            return AccessProfile.from_counts(self.counts, rows=self.rows)
        return AccessProfile.power_law(self.rows, float(self.alpha))


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A DLRM-style model and its batches: embedding tables plus dense MLPs."""

    name: str
    tables: tuple[TableStats, ...]
    batch_size_per_rank: int = 512
    dense_in_features: int = 13
    bottom_mlp: tuple[int, ...] = (512, 256, 128)
    top_mlp: tuple[int, ...] = (1024, 1024, 512, 256, 1)
    optimizer: str = "sgd"
    """Embedding optimizer; decides the state bytes that travel with each row."""
    dtype_bytes: int = 4

    def __post_init__(self) -> None:
        _check(len(self.tables) > 0, f"workload {self.name!r} has no tables")
        names = [t.name for t in self.tables]
        dupes = sorted(name for name, count in Counter(names).items() if count > 1)
        _check(
            not dupes,
            f"workload {self.name!r}: duplicate table names {dupes}: names must be unique",
        )
        _check(self.batch_size_per_rank >= 1, "batch_size_per_rank must be >= 1")
        _check(
            self.optimizer in OPTIMIZER_STATE,
            f"optimizer {self.optimizer!r} is not one of {sorted(OPTIMIZER_STATE)}",
        )

    def table(self, name: str) -> TableStats:
        for t in self.tables:
            if t.name == name:
                return t
        raise UnknownTableError(f"no table {name!r}; tables are {[t.name for t in self.tables]}")

    def row_bytes(self, table: TableStats) -> int:
        """Bytes of one row with its optimizer state."""
        state = OPTIMIZER_STATE[self.optimizer](table.dim) * self.dtype_bytes
        return table.dim * self.element_bytes(table) + state

    def element_bytes(self, table: TableStats) -> int:
        """Bytes per element of `table`'s rows."""
        return table.row_dtype_bytes or self.dtype_bytes


@dataclass(frozen=True, kw_only=True)
class Topology:
    """The hardware a plan runs on; bandwidths are per rank.

    Presets and measurement: `distcache.planner.topology` (`preset`, `load`) and
    `python -m distcache calibrate`.
    """

    name: str
    world_size: int
    ranks_per_node: int
    compute_device: str = "cuda"
    """'cuda' or 'cpu' (on CPU the "device" memory is host memory)."""
    device_memory_bytes: int
    """Per rank, available to embeddings (rows, caches, optimizer state)."""
    host_memory_bytes: int
    """Per rank, available to host-resident tables."""
    device_memory_bw_bytes_per_s: float
    host_to_device_bw_bytes_per_s: float
    device_to_host_bw_bytes_per_s: float | None = None
    """A cache's write-backs' rate, the link's other direction (calibrated on CUDA: pinned
    copies each way); None: `host_to_device_bw_bytes_per_s` (on CPU the stager's, both ways)."""
    host_to_device_latency_s: float = 10e-6
    intra_node_bw_bytes_per_s: float
    inter_node_bw_bytes_per_s: float
    network_latency_s: float = 20e-6
    dense_flops_per_s: float
    """Achieved (not peak) rate of the dense MLPs, forward + backward."""
    lookup_rows_per_s: float | None = None
    """Measured embedding-bag rows/s; None: derived from device memory bandwidth."""
    # Measured by `python -m distcache calibrate`; the defaults are the GPU presets'.
    lookup_bytes_per_s: float | None = None
    """With `lookup_rows_per_s`: the per-byte part of a lookup's cost (rows of different widths
    cost differently), measured at two widths; None: rows/s alone."""
    device_lookup_rows_per_s: float | None = None
    """Measured rows/s of the kernel serving device-stored tables (TorchRec's fused kernel,
    FBGEMM's; data-parallel tables too); None: `lookup_rows_per_s` (distcache's kernel)."""
    device_lookup_bytes_per_s: float | None = None
    """With `device_lookup_rows_per_s`: its per-byte part; None: rows/s alone."""
    cache_scan_rows_per_s: float | None = None
    """Cache slots per second a look-ahead cache is priced at as if its scheduler scored every
    slot once per batch with misses: for topologies calibrated before the `schedule_*` figures
    below, used only where those are None; None too: not priced (the GPU presets)."""
    schedule_s_per_id: float | None = None
    """Seconds of a look-ahead cache's scheduler per id of a batch (it enters the window:
    sorted, deduplicated, linked to its rows' earlier uses), measured with the real scheduler
    by `calibrate` (`distcache.tools.schedbench`); None: not measured (the presets, older
    calibrations), `cache_scan_rows_per_s` prices the scheduler instead."""
    schedule_s_per_candidate: float | None = None
    """With `schedule_s_per_id`: seconds per slot its victim choice scores
    (`rates.scheduled_candidates`: the sweep's, or every slot of a small cache)."""
    reactive_cache_s_per_id: float | None = None
    """Device seconds per id of a reactive (LRU) cache's own work on a GPU: FBGEMM's UVM cache's
    (`tools.uvmbench`: its misses' copies included, so such caches have no staging term),
    priced for every reactive cache; None: not priced (presets, CPU)."""
    reactive_cache_s_per_miss: float | None = None
    """With `reactive_cache_s_per_id`: device seconds per row such a cache loads (FBGEMM's UVM
    cache at two sizes, `tools.uvmbench`); None: its misses are in the per-id figure."""
    dense_update_bytes_per_s: float | None = None
    """Table bytes per second of a data-parallel table's dense gradient and update (fill,
    accumulate, optimizer step over every row); None: device memory bandwidth divided by the
    passes `rates.DENSE_UPDATE_PASSES` counts."""
    dense_activation_bytes_per_s: float | None = None
    """Rate of the dense layers' memory-bound activation traffic (bias, ReLU, their gradients);
    None: not priced apart (the GPU presets' achieved `dense_flops_per_s` covers it)."""
    interaction_s_per_element: float | None = None
    """Seconds per sample, per element of the F vectors of D dims (F·D of them), of DLRM's dot
    interaction forward + backward (its input assembled from the collection's pooled output,
    batched products of F x D matrices, the pairs' gather and their gradients): on a CPU these
    small products run far below the MLPs' rate and their cost follows the vectors' elements
    more than the flops; None: the interaction is priced as a dense layer (flops at
    `dense_flops_per_s`, activations at `dense_activation_bytes_per_s`; the GPU presets)."""
    interaction_s_per_pair: float = 0.0
    """With `interaction_s_per_element`: seconds per sample per entry of the F x F product."""
    dense_layer_overhead_s: float = 0.0
    """Host time per dense layer per step (dispatch of its forward, backward and update, on a
    GPU the launches the device waits for); 0 on the GPU presets, which assume them hidden."""
    step_overhead_s: float = 0.0
    """Host time per step outside every priced term (the training framework: DMP, DDP, the
    pipeline, loss); 0 on the GPU presets (as above)."""
    sharding_overhead_s: float = 0.0
    """Host time per step and rank for each sharding type a plan uses (its input and output
    distribution, lookup module and per-batch cache calls); 0 on the GPU presets (as above)."""
    id_overhead_s: float = 0.0
    """Host time per bag routed (a sample's ids of one feature; measured with one id a bag,
    hence the name), on the rank sending it and on the rank serving it (TorchRec's input
    distribution outside the cache kernel: bucketing, permutes, validation); 0 on the GPU
    presets (as above)."""
    hot_bag_overhead_s: float = 0.0
    """Host time per bag (a sample's ids of one feature) of a table with hot rows
    (`TablePlan.hot_rows`), on every rank: the batch split into hot and cold ids, the
    replica's pooling and its addition into the output, their backward, beyond the lookups
    priced at the lookup rates (calibrated at one id a bag; measured, the cost follows bags
    more than ids: at four ids a bag it is about half what per id would give); 0 on the GPU
    presets (as above)."""
    row_wise_output_slowdown: float = 1.0
    """How much longer a byte of a row-wise table's outputs takes than an all-to-all's on the
    same link: TorchRec's reduce-scatter of the partial sums (forward) and all-gather of their
    gradients (backward), against the link's rate, calibrated on one node (gloo runs them
    slower than its all-to-all); 1 on the GPU presets (NCCL runs them alike)."""
    row_wise_output_latency_s: float = 0.0
    """Their latency per step beyond the two sync latencies every routed sharding type's
    outputs are priced with, for a plan with row-wise tables."""
    sync_latency_s: float | None = None
    """What a collective costs when the ranks arrive from their own computation, the wait for
    a peer the OS descheduled included (CPU ranks sharing cores); None: `network_latency_s`
    (the GPU presets: each rank has its own GPU and host cores)."""
    calibration: str | None = None
    """Where and when `calibrate` measured it (host, device, torch, UTC date), and what it
    could not measure there; None for a preset."""

    def __post_init__(self) -> None:
        _check(self.world_size >= 1, f"world_size must be >= 1, got {self.world_size}")
        _check(
            1 <= self.ranks_per_node,
            f"ranks_per_node must be >= 1, got {self.ranks_per_node}",
        )
        _check(
            self.compute_device in ("cuda", "cpu"),
            f"compute_device must be 'cuda' or 'cpu', got {self.compute_device!r}",
        )
        for name in (
            "device_memory_bytes", "host_memory_bytes", "device_memory_bw_bytes_per_s",
            "host_to_device_bw_bytes_per_s", "intra_node_bw_bytes_per_s",
            "inter_node_bw_bytes_per_s", "dense_flops_per_s", "row_wise_output_slowdown",
        ):  # fmt: skip
            _check(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "lookup_bytes_per_s", "device_lookup_rows_per_s", "device_lookup_bytes_per_s",
            "device_to_host_bw_bytes_per_s", "cache_scan_rows_per_s", "dense_update_bytes_per_s",
            "dense_activation_bytes_per_s", "interaction_s_per_element", "sync_latency_s",
            "reactive_cache_s_per_id", "reactive_cache_s_per_miss",
        ):  # fmt: skip
            value = getattr(self, name)
            _check(value is None or value > 0, f"{name} must be > 0 or None, got {value}")
        for name in (
            "interaction_s_per_pair", "row_wise_output_latency_s", "dense_layer_overhead_s",
            "step_overhead_s", "sharding_overhead_s", "id_overhead_s", "hot_bag_overhead_s",
        ):  # fmt: skip
            _check(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        _check(self.reactive_cache_s_per_miss is None or self.reactive_cache_s_per_id, "reactive_"
               "cache_s_per_miss needs reactive_cache_s_per_id, got None")  # fmt: skip
        per_id, per_candidate = self.schedule_s_per_id, self.schedule_s_per_candidate
        for name, value in (("per_id", per_id), ("per_candidate", per_candidate)):  # fits: >= 0
            _check(value is None or value >= 0, f"schedule_s_{name} must be >= 0, got {value}")
        _check(
            (per_id is None) == (per_candidate is None),
            f"schedule_s_per_id and _per_candidate: both or neither, got {per_id}, {per_candidate}",
        )

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.ranks_per_node)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Topology:
        allowed = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - allowed)
        _check(not unknown, f"unknown topology keys {unknown}; allowed: {sorted(allowed)}")
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class TablePlan:
    """Where one table lives."""

    table: str
    sharding: str
    """One of SHARDING_TYPES."""
    ranks: tuple[int, ...]
    """Ranks holding a shard (data parallel: every rank; table-wise: one rank; row-/column-wise:
    one shard per listed rank, rows or columns split evenly)."""
    storage: str = DEVICE
    """One of STORAGES; data-parallel tables are always on the device."""
    cache_fraction: float = 1.0
    """Fraction of each shard's rows the device cache holds (1.0 for `device` storage)."""
    lookahead: int = 0
    prefetch_depth: int = 0
    hot_rows: int = 0
    """The table's likeliest rows replicated on every rank (`distcache.sharding.hot_rows`): their
    lookups stay on the rank, their gradients are summed over the ranks; 0 for none (data
    parallel: 0)."""
    hot_reduce: str = HOT_ALL
    """How the replica's gradient is summed each step: one of HOT_REDUCE (`CacheConfig.hot_reduce`):
    all of its rows all-reduced, or only the rows each rank touched, all-gathered."""

    def __post_init__(self) -> None:
        # (The solver makes thousands: each message is formatted only when its check fails.)
        problem = next(self._problems(), None)
        if problem is not None:
            raise DistcacheConfigError(f"table {self.table!r}: {problem}")

    def _problems(self) -> Iterator[str]:
        """What is wrong with this plan of one table, first things first."""
        if self.sharding not in SHARDING_TYPES:
            yield f"sharding {self.sharding!r} is not one of {SHARDING_TYPES}"
        if self.storage not in STORAGES:
            yield f"storage {self.storage!r} is not one of {STORAGES}"
        if len(self.ranks) < 1:
            yield "ranks must not be empty"
        if self.sharding == TABLE_WISE and len(self.ranks) != 1:
            yield f"table-wise sharding has one rank, got {self.ranks}"
        if not 0 < self.cache_fraction <= 1:
            yield f"cache_fraction must be in (0, 1], got {self.cache_fraction}"
        if self.storage != HOST_CACHED and self.cache_fraction != 1.0:
            yield "device storage holds every row (cache_fraction 1.0)"
        if self.sharding == DATA_PARALLEL and self.storage != DEVICE:
            yield "data-parallel tables are stored on the device"
        if not isinstance(self.hot_rows, int) or self.hot_rows < 0:
            yield f"hot_rows must be an int >= 0, got {self.hot_rows!r}"
        if self.sharding == DATA_PARALLEL and self.hot_rows != 0:
            yield f"a data-parallel table is replicated whole (hot_rows 0), got {self.hot_rows}"
        if self.hot_reduce not in HOT_REDUCE:
            yield f"hot_reduce {self.hot_reduce!r} is not one of {HOT_REDUCE}"
        if not 0 <= self.prefetch_depth <= self.lookahead:
            yield (
                f"expected 0 <= prefetch_depth <= lookahead, got {self.prefetch_depth} and "
                f"{self.lookahead}"
            )

    @property
    def placement(self) -> Placement:
        """How the table is placed, its ranks counted (`Placement.shards`)."""
        return Placement(shards=len(self.ranks), **{name: getattr(self, name) for name in _PLACED})


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """How one table is placed, short of which ranks hold it: what the cost model prices
    (`shards.shard_terms`) and the solver chooses among (`candidates.Mode`). The fields are
    `TablePlan`'s, with the number of its ranks for the ranks themselves. A `TablePlan`, which
    validates what enters from outside the solver, is a placement on named ranks
    (`TablePlan.placement`, `Placement.table_plan`)."""

    sharding: str
    """One of SHARDING_TYPES."""
    shards: int
    """Shards (ranks) of the table: 1 table-wise, every rank data-parallel and row-wise, a
    node's ranks table-row-wise."""
    storage: str = DEVICE
    cache_fraction: float = 1.0
    lookahead: int = 0
    prefetch_depth: int = 0
    hot_rows: int = 0
    hot_reduce: str = HOT_ALL

    def table_plan(self, table: str, ranks: tuple[int, ...]) -> TablePlan:
        """`table` placed so on `ranks` (`shards` of them)."""
        return TablePlan(
            table=table, ranks=ranks, **{name: getattr(self, name) for name in _PLACED}
        )


_PLACED = tuple(f.name for f in fields(Placement) if f.name != "shards")
"""The fields a `Placement` shares with a `TablePlan`."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A placement of every table of a workload, with the planner's reasons."""

    name: str
    tables: tuple[TablePlan, ...]
    explanations: dict[str, str] = field(default_factory=dict, compare=False)
    """Per table: why this placement, and the alternatives rejected with their modelled cost."""

    def table(self, name: str) -> TablePlan:
        for t in self.tables:
            if t.table == name:
                return t
        raise UnknownTableError(
            f"no table {name!r} in the plan; it places {[t.table for t in self.tables]}"
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "tables": [asdict(t) for t in self.tables],
                "explanations": self.explanations,
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        tables = tuple(
            TablePlan(**{**t, "ranks": tuple(t["ranks"])}) for t in data.get("tables", [])
        )
        return cls(
            name=data.get("name", "plan"),
            tables=tables,
            explanations=data.get("explanations", {}),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(Path(path).read_text())


@dataclass(frozen=True, kw_only=True)
class StepCost:
    """Modelled time of one training step on one rank, per term, in seconds."""

    dense_compute_s: float = 0.0
    lookup_s: float = 0.0
    staging_s: float = 0.0
    """Staging traffic (loads + dirty write-backs) of the look-ahead caches."""
    exposed_staging_s: float = 0.0
    """The part of `staging_s` not hidden behind compute (overlap up to compute's length)."""
    input_all_to_all_s: float = 0.0
    output_all_to_all_s: float = 0.0
    all_reduce_s: float = 0.0
    overhead_s: float = 0.0
    """Host time of the framework: per step, per sharding type and per id this rank sends
    (`Topology.step_overhead_s`, `sharding_overhead_s`, `id_overhead_s`)."""

    @property
    def total_s(self) -> float:
        return (
            self.overhead_s
            + self.dense_compute_s
            + self.lookup_s
            + self.exposed_staging_s
            + self.input_all_to_all_s
            + self.output_all_to_all_s
            + self.all_reduce_s
        )


@dataclass(frozen=True, kw_only=True)
class PlanCost:
    """A plan priced on a topology: per-rank step terms and memory."""

    per_rank: tuple[StepCost, ...]
    device_memory_bytes: tuple[int, ...]
    host_memory_bytes: tuple[int, ...]
    global_batch_size: int
    loads_per_step: tuple[float, ...] = ()
    """Rows each rank's caches load per step (`caches.rank_caches`: the tables of one cache on
    a rank share it)."""
    fits: bool
    """Whether every rank's device and host memory fit the topology's limits and every cache
    holds the working set of its batches in flight."""
    violations: tuple[str, ...] = ()
    """Why the plan does not fit (memory per rank, caches smaller than their working set)."""

    @property
    def step_s(self) -> float:
        """Synchronous training: the slowest rank sets the step."""
        return max(c.total_s for c in self.per_rank)

    @property
    def samples_per_s(self) -> float:
        return self.global_batch_size / self.step_s if self.step_s > 0 else float("inf")


@dataclass(frozen=True, kw_only=True)
class SolverOptions:
    """What `solve` may choose from, and how far it may search."""

    shardings: tuple[str, ...] = SOLVER_SHARDINGS
    """Allowed sharding types."""
    storages: tuple[str, ...] = STORAGES
    """Allowed storages for sharded tables (data parallel is always on the device)."""
    cache_fractions: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
    """Cache sizes tried for host-cached shards, as fractions of the shard's rows."""
    lookaheads: tuple[int, ...] = (DEFAULT_LOOKAHEAD,)
    """Look-ahead depths L tried for caches; 0 is a reactive (LRU) cache."""
    prefetch_depths: tuple[int, ...] = (1,)
    """Prefetch depths K tried with each L (pairs with K > L are skipped; L = 0 uses K = 0)."""
    column_wise_shards: tuple[int, ...] = (2, 4)
    """Shard counts tried for column-wise tables (those dividing the dim, at most the ranks)."""
    max_moves: int = 1000
    """Local-search moves tried over all starts (the best start gets twice the others' share).
    A budget of moves, not seconds, keeps the plan deterministic; the search often stops
    earlier, when no move helps (1000 synthetic tables on 128 H100s: ~500 moves, ~1.5 s).
    0: greedy only."""
    time_limit_s: float = 120.0
    """Safety limit on the local search's wall time, far above a normal run (1000 tables on
    128 ranks: ~1.5 s of search, ~5 s in all on 2 shared CPU cores). Only a runaway search
    reaches it; the plan then depends on the machine's speed, and a warning says so."""
    hot_row_shares: tuple[float, ...] = (0.25, 0.5, 0.75, 0.9)
    """Per sharded table, replicas tried of the fewest likeliest rows taking each share of its
    lookups (`hot.py`); () for none."""
    explain: bool | tuple[str, ...] = True
    """Fill `Plan.explanations`: for every table (True), none (False) or those named."""

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise DistcacheConfigError(f"SolverOptions: {message}")

        bad = [s for s in self.shardings if s not in SOLVER_SHARDINGS]
        check(self.shardings and not bad, f"shardings {bad or '()'} not in {SOLVER_SHARDINGS}")
        bad = [s for s in self.storages if s not in STORAGES]
        check(self.storages and not bad, f"storages {bad or '()'} not in {STORAGES}")
        check(
            all(0 < f <= 1 for f in self.cache_fractions),
            f"cache_fractions must lie in (0, 1], got {self.cache_fractions}",
        )
        check(
            HOST_CACHED not in self.storages or bool(self.cache_fractions),
            "host_cached storage needs at least one cache fraction",
        )
        check(all(v >= 0 for v in self.lookaheads), f"lookaheads must be >= 0: {self.lookaheads}")
        check(
            bool(self.lookaheads) and bool(self.prefetch_depths),
            "lookaheads and prefetch_depths must not be empty",
        )
        check(
            all(v >= 0 for v in self.prefetch_depths),
            f"prefetch_depths must be >= 0: {self.prefetch_depths}",
        )
        check(
            all(s >= 2 for s in self.column_wise_shards),
            f"column_wise_shards must be >= 2: {self.column_wise_shards}",
        )
        check(
            all(0 < s < 1 for s in self.hot_row_shares),
            f"hot_row_shares must lie in (0, 1), got {self.hot_row_shares}",
        )
        check(self.max_moves >= 0, f"max_moves must be >= 0, got {self.max_moves}")
        check(self.time_limit_s > 0, f"time_limit_s must be > 0, got {self.time_limit_s}")

    def lookahead_pairs(self) -> tuple[tuple[int, int], ...]:
        """The (L, K) pairs tried for caches."""
        pairs = {(L, K) for L in self.lookaheads for K in self.prefetch_depths if K <= L}
        pairs |= {(0, 0) for L in self.lookaheads if L == 0}
        return tuple(sorted(pairs))
