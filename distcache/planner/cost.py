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
  shard rows·(8 B look-ahead or LRU index), + data-parallel tables R·r on every rank;
  host = shard rows·r for host-cached shards. Row-wise shards are priced at ceil(R/S) rows.

The model is written in stages: `binned.py` (access statistics), `shards.py` (per-shard
terms), `dense.py` (dense compute and all-reduce); this file accumulates them per rank and
prices whole plans. Every public name of those stages is importable from here too.

Statistics come from a `BinnedProfile` of each table (rows grouped into bins of near-equal
probability), so a 40M-row table costs a few thousand operations per query; it agrees with
the exact `AccessProfile` functions to well under 1 % (tests/unit/planner/test_binned.py).

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
from distcache.planner.binned import BinnedProfile, table_access
from distcache.planner.dense import (
    ACTIVATION_IN_PASSES,
    ACTIVATION_OUT_PASSES,
    all_reduce_s,
    dense_compute_s,
    dense_flops_per_sample,
    dense_layers,
    dense_parameter_bytes,
    sync_latency_s,
)
from distcache.planner.shards import (
    ACCESS_BYTES,
    CACHE_ROW_INDEX_BYTES_LOOKAHEAD,
    CACHE_ROW_INDEX_BYTES_REACTIVE,
    CACHE_SLOT_BYTES,
    DENSE_UPDATE_PASSES,
    ID_BYTES,
    ShardTerms,
    dense_update_time_s,
    lookup_time_s,
    sent_ids_per_rank,
    shard_access,
    shard_terms,
    staging_time_s,
    table_plan_terms,
)
from distcache.planner.types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    Plan,
    PlanCost,
    StepCost,
    Topology,
    Workload,
)

INPUT_COLLECTIVES = 3  # per sharding type: TorchRec's splits, lengths and values all-to-alls
OUTPUT_COLLECTIVES = 2  # per sharding type: pooled embeddings forward, gradients backward

__all__ = [
    "ACCESS_BYTES",
    "ACTIVATION_IN_PASSES",
    "ACTIVATION_OUT_PASSES",
    "CACHE_ROW_INDEX_BYTES_LOOKAHEAD",
    "CACHE_ROW_INDEX_BYTES_REACTIVE",
    "CACHE_SLOT_BYTES",
    "DENSE_UPDATE_PASSES",
    "ID_BYTES",
    "INPUT_COLLECTIVES",
    "OUTPUT_COLLECTIVES",
    "RANK_TERMS",
    "BinnedProfile",
    "GlobalTerms",
    "ShardTerms",
    "a2a_time_s",
    "all_reduce_s",
    "dense_compute_s",
    "dense_flops_per_sample",
    "dense_layers",
    "dense_parameter_bytes",
    "dense_update_time_s",
    "global_terms",
    "lookup_time_s",
    "node_layout",
    "peer_counts",
    "plan_cost",
    "rank_totals",
    "sent_ids_per_rank",
    "shard_access",
    "shard_contribution",
    "shard_terms",
    "staging_time_s",
    "sync_latency_s",
    "table_access",
    "table_plan_terms",
    "validate_plan",
]

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
