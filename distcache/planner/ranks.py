"""Per-rank terms of the cost model: what a plan's tables put on each rank per step, and the
step time each rank takes from them.

A table's shards add work (lookups, staging), all-to-all bytes and memory to the ranks that
hold them, and all-to-all bytes to every rank that consumes them (all do). `RankTerms` holds
these per rank as named rows of one [TERMS, W] array, so a plan's terms are the sum of its
tables' — one array addition per table, which the solver's search relies on. `rank_step` is
the one place the terms become a step time (formula in `cost.py`'s docstring); `plan_cost`
and the solver's pricing both call it.

Example::

    whole = Placement(sharding=TABLE_WISE, shards=1)
    terms = shard_contribution(shard_terms(table, workload, topology, whole), (3,), topology)
    step = rank_step_of(terms, dense_s=0.001, topology=topology).total_s()  # [W] seconds
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
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
TRAFFIC = slice(_IDS.start, _EMB.stop)  # the all-to-all rows: ids, then embeddings
_LOOKUP, _OVERLAPPED, _EXPOSED, _DEVICE, _HOST = (
    RANK_TERMS.index(name)
    for name in (
        "lookup_s",
        "overlapped_staging_s",
        "exposed_staging_s",
        "device_memory_bytes",
        "host_memory_bytes",
    )
)


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


def _row(name: str) -> property:
    index = RANK_TERMS.index(name)
    return property(lambda self: self.values[index], doc=f"[W] {name} per rank.")


class RankTerms:
    """What tables put on each rank per step: named rows (`RANK_TERMS`) of one [TERMS, W]
    float64 array, so that adding or removing a table is one array operation."""

    __slots__ = ("emb", "ids", "traffic", "values")

    def __init__(self, values: np.ndarray):
        self.values = values  # [TERMS, W] float64
        self.traffic = values[TRAFFIC]
        """[8, W] the all-to-alls' rows: `ids`, then `emb`."""
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
    return RankTerms(shard_contributions([terms], ranks, topology)[0])


def shard_contributions(
    terms: Sequence[ShardTerms], ranks: tuple[int, ...], topology: Topology
) -> np.ndarray:
    """[V, TERMS, W]: `shard_contribution` of a table on `ranks` as each of `terms` (V ways to
    place one layout: a sharding and shard count)."""
    if len(terms) > 1:  # each column for all at once (for one, row by row costs less)
        return _contributions(terms, ranks, topology)
    values = np.zeros((len(terms), len(RANK_TERMS), topology.world_size))
    owners = _owner_index(tuple(ranks))
    for out, t in zip(values, terms, strict=True):
        out[_LOOKUP, owners] = t.lookup_s
        out[_OVERLAPPED if t.staging_overlapped else _EXPOSED, owners] = t.staging_s
        out[_DEVICE, owners] = t.device_memory_bytes
        out[_HOST, owners] = t.host_memory_bytes
        if t.ids_bytes_per_peer or t.embedding_bytes_per_peer:  # sharded: ids, outputs routed
            units = owner_units(tuple(ranks), topology, t.reduced_in_node)  # [8, W]
            np.multiply(units[:4], t.ids_bytes_per_peer, out=out[_IDS])
            np.multiply(units[4:], t.embedding_bytes_per_peer, out=out[_EMB])
        if t.hot_rows:  # the replica of its hot rows, on every rank
            out[_LOOKUP] += t.hot_lookup_s
            out[_DEVICE] += t.hot_device_bytes
    return values


def _contributions(
    terms: Sequence[ShardTerms], ranks: tuple[int, ...], topology: Topology
) -> np.ndarray:
    """`shard_contributions` of several `terms`, each term's column at once."""
    values = np.zeros((len(terms), len(RANK_TERMS), topology.world_size))
    columns = np.array(  # [V, 9, 1]
        [
            (
                t.lookup_s,
                *t.staging_parts,
                t.device_memory_bytes,
                t.host_memory_bytes,
                t.ids_bytes_per_peer,
                t.embedding_bytes_per_peer,
                t.hot_lookup_s,  # 0 without a replica: x + 0 is x
                t.hot_device_bytes,
            )
            for t in terms
        ],
        dtype=np.float64,
    )[..., None]
    owners = _owner_index(tuple(ranks))
    values[:, : _IDS.start, owners] = columns[:, :3]  # lookups, overlapped, exposed staging
    values[:, _DEVICE:, owners] = columns[:, 3:5]
    if columns[:, 5:7].any():  # sharded: ids and outputs routed (not data parallel)
        units = owner_units(tuple(ranks), topology, terms[0].reduced_in_node)  # [8, W]
        values[:, _IDS] = units[:4] * columns[:, 5:6]
        values[:, _EMB] = units[4:] * columns[:, 6:7]
    if any(t.hot_rows for t in terms):  # the replica of its hot rows, on every rank
        values[:, _LOOKUP] += columns[:, 7]
        values[:, _DEVICE] += columns[:, 8]
    return values


@functools.lru_cache(maxsize=1024)
def _owner_index(ranks: tuple[int, ...]) -> slice | np.ndarray:
    """An index of `ranks` along a [W] axis: a slice where they are consecutive."""
    if ranks and ranks == tuple(range(ranks[0], ranks[0] + len(ranks))):
        return slice(ranks[0], ranks[0] + len(ranks))
    return np.array(ranks)


def traffic_units(is_owner: np.ndarray, topology: Topology, reduced: bool) -> np.ndarray:
    """[8, ..., W] the `RankTerms` all-to-all rows (ids, then embeddings) of a table whose
    shards sit where `is_owner` [..., W] is 1, per byte of ids and per byte of embeddings each
    consumer exchanges with a shard (`exchange`; `reduced_in_node` for table-row-wise): the
    ids rows times the ids' bytes and the others times the embeddings' are the bytes."""
    peers = peer_counts(is_owner, topology)
    ids = (peers.owners_on_node, peers.owners_off_node)
    ids += (peers.consumers_on_node, peers.consumers_off_node)
    emb = _reduced_units(is_owner, topology) if reduced else (*ids[2:], *ids[:2])
    units = np.empty((8, *np.shape(is_owner)))
    for row, value in zip(units, (*ids, *emb), strict=True):
        row[...] = value
    return units


@functools.lru_cache(maxsize=1024)
def owner_units(ranks: tuple[int, ...], topology: Topology, reduced: bool) -> np.ndarray:
    """`traffic_units` of a table whose shards sit on `ranks` (kept: the solver asks for the
    same few rank sets again and again)."""
    is_owner = np.zeros(topology.world_size)  # [W]
    is_owner[list(ranks)] = 1.0
    units = traffic_units(is_owner, topology, reduced)
    units.flags.writeable = False
    return units


def reduced_in_node(emb_bytes: float, is_owner: np.ndarray, topology: Topology) -> Traffic:
    """The output traffic per rank [W] of a table-row-wise table (TorchRec's TWRW and grid),
    whose owners are whole nodes, each shard's partial sums `emb_bytes` per consumer rank.

    Each owner node reduce-scatters its k ranks' partial sums of all W consumers' bags (an
    owner sends and receives (k-1)/k of W·emb_bytes over NVLink); the owner of local index j
    then holds the full sums of the bags of every rank of local index j, and sends each rank
    of another node its share, emb_bytes, over the NIC (TorchRec's cross-node all-to-all among
    the ranks of one local index). Every rank receives emb_bytes from each owner node but its
    own. Backward sends the gradients back the same way."""
    return Traffic(*(unit * emb_bytes for unit in _reduced_units(is_owner, topology)))


def _reduced_units(is_owner: np.ndarray, topology: Topology) -> Traffic:
    """`reduced_in_node` per byte of partial sums, for owners `is_owner` [..., W] (whole
    nodes)."""
    node, starts, node_size = node_layout(topology)
    world = topology.world_size
    owner_nodes = np.add.reduceat(is_owner, starts, axis=-1) > 0  # [..., N]
    on_owner_node = owner_nodes[..., node].astype(np.float64)  # [..., W]
    reduce_scatter = is_owner * (node_size - 1) / node_size * world
    # Ranks of my local index on other nodes: one per other node (full nodes).
    others = len(starts) - 1
    return Traffic(
        sent_intra=reduce_scatter,
        sent_inter=is_owner * others,
        received_intra=reduce_scatter,
        received_inter=owner_nodes.sum(axis=-1, keepdims=True) - on_owner_node,
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


def all_to_all_s(traffic: np.ndarray, topology: Topology) -> np.ndarray:
    """[2, ..., W]: the input (ids) and output (embeddings) all-to-alls' time per rank,
    without latency, of `traffic` [8, ..., W] (`RankTerms.traffic`): links are full duplex and
    NVLink and the NIC run at once, so the slowest of the four directions and links sets each."""
    # [collective, direction (sent, received), link (intra, inter), ..., W]
    by_link = traffic.reshape(2, 2, 2, *traffic.shape[1:])
    busier = np.maximum(by_link[:, 0], by_link[:, 1])  # [collective, link, ..., W]
    return np.maximum(
        busier[:, 0] / topology.intra_node_bw_bytes_per_s,
        busier[:, 1] / topology.inter_node_bw_bytes_per_s,
    )


def rank_step(
    *,
    dense_s: float,
    lookup_s: np.ndarray,
    overlapped_staging_s: np.ndarray,
    exposed_staging_s: np.ndarray,
    traffic: np.ndarray,
    topology: Topology,
    traffic_rows: np.ndarray | None = None,
) -> RankStep:
    """The step per rank from its terms (any shape [..., W]: the solver prices many
    placements at once) — the only place the step's formula is written.

    Args:
        dense_s: dense compute per step.
        lookup_s, overlapped_staging_s, exposed_staging_s: as in `RankTerms`.
        traffic: [8, ..., W] the all-to-alls' bytes, as `RankTerms.traffic`.
        topology: the link rates.
        traffic_rows: [R] where the terms are rows [..., R, W] sharing fewer traffics
            [8, ..., T, W]: the traffic of each row.
    """
    compute = dense_s + lookup_s
    ids_s, emb_s = all_to_all_s(traffic, topology)
    output = 2 * emb_s
    if traffic_rows is not None:
        ids_s, output = (np.take(x, traffic_rows, axis=-2) for x in (ids_s, output))
    return RankStep(
        compute_s=compute,
        exposed_staging_s=expose_staging(compute, overlapped_staging_s, exposed_staging_s),
        input_all_to_all_s=ids_s,
        output_all_to_all_s=output,
    )


def rank_step_of(terms: RankTerms, *, dense_s: float, topology: Topology) -> RankStep:
    """`rank_step` of accumulated terms."""
    return rank_step(
        dense_s=dense_s,
        lookup_s=terms.lookup_s,
        overlapped_staging_s=terms.overlapped_staging_s,
        exposed_staging_s=terms.exposed_staging_s,
        traffic=terms.traffic,
        topology=topology,
    )
