"""Per-rank terms of the cost model: what a plan's tables put on each rank per step, and the
step time each rank takes from them.

A table's shards add work (lookups, staging), all-to-all bytes and memory to the ranks that
hold them, and all-to-all bytes to every rank that consumes them (all do). `RankTerms` holds
these per rank as named rows of one [TERMS, W] array, so a plan's terms are the sum of its
tables' — one array addition per table, which the solver's search relies on. `rank_step` is
the one place the terms become a step time (formula in `cost.py`'s docstring); `plan_cost`
and the solver's pricing both call it.

Example::

    terms = shard_contribution(shard_terms(table, workload, topology, sharding=TABLE_WISE,
                                           shards=1), (3,), topology)
    step = rank_step_of(terms, dense_s=0.001, topology=topology).total_s()  # [W] seconds
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from distcache.planner.shards import ShardTerms
from distcache.planner.types import Topology

# The rows of a `RankTerms` array, in order.
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
_IDS = slice(RANK_TERMS.index("ids_sent_intra_bytes"), RANK_TERMS.index("emb_sent_intra_bytes"))
_EMB = slice(_IDS.stop, RANK_TERMS.index("device_memory_bytes"))


class Traffic(NamedTuple):
    """Bytes one all-to-all moves per rank and step, by direction and link ([..., W] arrays or
    scalars): intra over NVLink (ranks of one node), inter over the NIC."""

    sent_intra: np.ndarray
    sent_inter: np.ndarray
    received_intra: np.ndarray
    received_inter: np.ndarray

    def plus(self, other: Traffic) -> Traffic:
        """Elementwise sum (`+` would concatenate the tuples)."""
        return Traffic(
            self.sent_intra + other.sent_intra,
            self.sent_inter + other.sent_inter,
            self.received_intra + other.received_intra,
            self.received_inter + other.received_inter,
        )

    def time_s(self, topology: Topology) -> np.ndarray:
        """The all-to-all's time per rank, without latency: links are full duplex and NVLink
        and the NIC run at once, so the slowest of the four directions and links sets it."""
        intra = np.maximum(self.sent_intra, self.received_intra)
        inter = np.maximum(self.sent_inter, self.received_inter)
        return np.maximum(
            intra / topology.intra_node_bw_bytes_per_s, inter / topology.inter_node_bw_bytes_per_s
        )


def _row(name: str) -> property:
    index = RANK_TERMS.index(name)
    return property(lambda self: self.values[index], doc=f"[W] {name} per rank.")


class RankTerms:
    """What tables put on each rank per step: named rows (`RANK_TERMS`) of one [TERMS, W]
    float64 array, so that adding or removing a table is one array operation."""

    __slots__ = ("emb", "ids", "values")

    def __init__(self, values: np.ndarray):
        self.values = values  # [TERMS, W] float64
        # Views of `values` (in-place updates keep them current), read on every pricing.
        self.ids = Traffic(*values[_IDS])
        """The input all-to-all's bytes: ids to the shards."""
        self.emb = Traffic(*values[_EMB])
        """The output all-to-all's bytes: pooled embeddings from the shards (forward; the
        backward sends their gradients back the same way)."""

    @classmethod
    def zeros(cls, world: int) -> RankTerms:
        return cls(np.zeros((len(RANK_TERMS), world)))

    @classmethod
    def stack(
        cls,
        *,
        lookup_s: np.ndarray | float,
        overlapped_staging_s: np.ndarray | float,
        exposed_staging_s: np.ndarray | float,
        ids: Traffic,
        emb: Traffic,
        device_memory_bytes: np.ndarray | float,
        host_memory_bytes: np.ndarray | float,
    ) -> RankTerms:
        """Terms from named rows ([W] arrays or scalars, broadcast)."""
        rows = (lookup_s, overlapped_staging_s, exposed_staging_s, *ids, *emb)
        rows += (device_memory_bytes, host_memory_bytes)
        return cls(np.stack(np.broadcast_arrays(*rows)).astype(np.float64))

    def __iadd__(self, other: RankTerms) -> RankTerms:
        self.values += other.values
        return self

    def __isub__(self, other: RankTerms) -> RankTerms:
        self.values -= other.values
        return self

    lookup_s = _row("lookup_s")
    overlapped_staging_s = _row("overlapped_staging_s")
    """Staging that may hide behind the rank's compute (look-ahead with K > 0 on a GPU)."""
    exposed_staging_s = _row("exposed_staging_s")
    """Staging on the critical path."""
    device_memory_bytes = _row("device_memory_bytes")
    host_memory_bytes = _row("host_memory_bytes")


@functools.lru_cache(maxsize=64)
def node_layout(topology: Topology) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(node of each rank [W], first rank of each node [N], ranks of each rank's node [W])."""
    ranks = np.arange(topology.world_size)
    node = ranks // topology.ranks_per_node
    starts = np.arange(0, topology.world_size, topology.ranks_per_node)
    sizes = np.diff(np.append(starts, topology.world_size))
    return node, starts, sizes[node].astype(np.float64)


class Peers(NamedTuple):
    """How many peers each rank exchanges with for one table, [..., W] each (or scalars)."""

    owners_on_node: np.ndarray
    """Ranks of my node holding a shard, me excepted: I send them ids."""
    owners_off_node: np.ndarray
    """Ranks of other nodes holding a shard."""
    consumers_on_node: np.ndarray
    """If I hold a shard: the other ranks of my node, which send me ids."""
    consumers_off_node: np.ndarray
    """If I hold a shard: the ranks of other nodes."""


def peer_counts(is_owner: np.ndarray, topology: Topology) -> Peers:
    """The `Peers` of each rank for a table whose shards sit where `is_owner` [..., W] is 1."""
    node, starts, node_size = node_layout(topology)
    on_node = np.add.reduceat(is_owner, starts, axis=-1)[..., node]  # [..., W]
    shards = is_owner.sum(axis=-1, keepdims=True)
    return Peers(
        owners_on_node=on_node - is_owner,
        owners_off_node=shards - on_node,
        consumers_on_node=is_owner * (node_size - 1),
        consumers_off_node=is_owner * (topology.world_size - node_size),
    )


def exchange(ids_bytes: float, emb_bytes: float, peers: Peers) -> tuple[Traffic, Traffic]:
    """(ids, embeddings) traffic per rank of a table each consumer sends `ids_bytes` of ids
    per shard and each shard answers with `emb_bytes` of embeddings: a rank sends ids to the
    owners and receives their embeddings; an owner receives ids from and sends embeddings to
    its consumers."""
    ids = Traffic(
        sent_intra=ids_bytes * peers.owners_on_node,
        sent_inter=ids_bytes * peers.owners_off_node,
        received_intra=ids_bytes * peers.consumers_on_node,
        received_inter=ids_bytes * peers.consumers_off_node,
    )
    emb = Traffic(
        sent_intra=emb_bytes * peers.consumers_on_node,
        sent_inter=emb_bytes * peers.consumers_off_node,
        received_intra=emb_bytes * peers.owners_on_node,
        received_inter=emb_bytes * peers.owners_off_node,
    )
    return ids, emb


def shard_contribution(terms: ShardTerms, ranks: tuple[int, ...], topology: Topology) -> RankTerms:
    """The rank terms of a table whose identical shards sit on `ranks`."""
    load = RankTerms.zeros(topology.world_size)
    owners = list(ranks)
    load.lookup_s[owners] = terms.lookup_s
    staged = load.overlapped_staging_s if terms.staging_overlapped else load.exposed_staging_s
    staged[owners] = terms.staging_s
    load.device_memory_bytes[owners] = terms.device_memory_bytes
    load.host_memory_bytes[owners] = terms.host_memory_bytes
    ids_bytes, emb_bytes = terms.ids_bytes_per_peer, terms.embedding_bytes_per_peer
    if ids_bytes or emb_bytes:  # sharded: ids and embeddings routed (not data parallel)
        is_owner = np.zeros(topology.world_size)  # [W]
        is_owner[owners] = 1.0
        ids, emb = exchange(ids_bytes, emb_bytes, peer_counts(is_owner, topology))
        if terms.reduced_in_node:
            emb = reduced_in_node(emb_bytes, is_owner, topology)
        for row, value in zip((*load.ids, *load.emb), (*ids, *emb), strict=True):
            row[:] = value
    if terms.hot_rows:  # the replica of its hot rows, on every rank
        load.lookup_s[:] += terms.hot_lookup_s
        load.device_memory_bytes[:] += terms.hot_device_bytes
    return load


def reduced_in_node(emb_bytes: float, is_owner: np.ndarray, topology: Topology) -> Traffic:
    """The output traffic per rank [W] of a table-row-wise table (TorchRec's TWRW and grid),
    whose owners are whole nodes, each shard's partial sums `emb_bytes` per consumer rank.

    Each owner node reduce-scatters its k ranks' partial sums of all W consumers' bags (an
    owner sends and receives (k-1)/k of W·emb_bytes over NVLink); the owner of local index j
    then holds the full sums of the bags of every rank of local index j, and sends each rank
    of another node its share, emb_bytes, over the NIC (TorchRec's cross-node all-to-all among
    the ranks of one local index). Every rank receives emb_bytes from each owner node but its
    own. Backward sends the gradients back the same way."""
    node, starts, node_size = node_layout(topology)
    world = topology.world_size
    owner_nodes = np.unique(node[is_owner > 0])
    on_owner_node = np.isin(node, owner_nodes).astype(np.float64)  # [W]
    reduce_scatter = is_owner * (node_size - 1) / node_size * world * emb_bytes
    # Ranks of my local index on other nodes: one per other node (full nodes).
    others = len(starts) - 1
    return Traffic(
        sent_intra=reduce_scatter,
        sent_inter=is_owner * others * emb_bytes,
        received_intra=reduce_scatter,
        received_inter=(len(owner_nodes) - on_owner_node) * emb_bytes,
    )


class RankStep(NamedTuple):
    """One step's time per rank in parts, [..., W] seconds each; what every rank pays alike
    (all-reduce, collective latencies, host overheads: `cost.GlobalTerms`) comes on top."""

    compute_s: np.ndarray
    """Dense compute and the rank's lookups."""
    exposed_staging_s: np.ndarray
    """Staging not hidden behind compute."""
    input_all_to_all_s: np.ndarray
    """Ids to the shards, without latencies."""
    output_all_to_all_s: np.ndarray
    """Embeddings from the shards, forward and backward, without latencies."""

    @property
    def core_s(self) -> np.ndarray:
        """The rank's own work: compute and exposed staging."""
        return self.compute_s + self.exposed_staging_s

    def total_s(self, shared_s: float = 0.0) -> np.ndarray:
        """The step per rank, with `shared_s` that every rank pays (`GlobalTerms.shared_s`)."""
        return self.core_s + (self.input_all_to_all_s + self.output_all_to_all_s) + shared_s


def expose_staging(
    compute_s: np.ndarray | float,
    overlapped_s: np.ndarray | float,
    exposed_s: np.ndarray | float,
) -> np.ndarray | float:
    """Staging on the critical path: overlapped staging hides behind up to `compute_s`."""
    return np.maximum(overlapped_s - compute_s, 0.0) + exposed_s


def rank_step(
    *,
    dense_s: float,
    lookup_s: np.ndarray,
    overlapped_staging_s: np.ndarray,
    exposed_staging_s: np.ndarray,
    ids: Traffic,
    emb: Traffic,
    topology: Topology,
) -> RankStep:
    """The step per rank from its terms (any shape [..., W]: the solver prices many
    placements at once) — the only place the step's formula is written.

    Args:
        dense_s: dense compute per step.
        lookup_s, overlapped_staging_s, exposed_staging_s, ids, emb: as in `RankTerms`.
        topology: the link rates.
    """
    compute = dense_s + lookup_s
    return RankStep(
        compute_s=compute,
        exposed_staging_s=expose_staging(compute, overlapped_staging_s, exposed_staging_s),
        input_all_to_all_s=ids.time_s(topology),
        output_all_to_all_s=2 * emb.time_s(topology),
    )


def rank_step_of(terms: RankTerms, *, dense_s: float, topology: Topology) -> RankStep:
    """`rank_step` of accumulated terms."""
    return rank_step(
        dense_s=dense_s,
        lookup_s=terms.lookup_s,
        overlapped_staging_s=terms.overlapped_staging_s,
        exposed_staging_s=terms.exposed_staging_s,
        ids=terms.ids,
        emb=terms.emb,
        topology=topology,
    )
