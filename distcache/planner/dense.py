"""The dense part of a step in the cost model: the MLPs' and interaction's compute, and the
all-reduce of their gradients (with any data-parallel table's). Formulas: `cost.py`.

Example::

    seconds = dense_compute_s(workload, topology) + all_reduce_s(
        dense_parameter_bytes(workload), topology
    )
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from distcache.planner.types import Topology, Workload

# Activation traffic per dense layer, in elements of its input (i) and output (o) per sample:
# forward product reads i, writes o; bias + ReLU read and write o; ReLU backward reads the
# gradient and the output and writes o; the backward products read o twice, read i, write i.
ACTIVATION_IN_PASSES, ACTIVATION_OUT_PASSES = 3, 7


def _mlp(in_features: int, layers: tuple[int, ...]) -> tuple[float, float]:
    """(forward flops per sample, parameters) of an MLP."""
    flops = params = 0.0
    for out in layers:
        flops += 2.0 * in_features * out
        params += in_features * out + out
        in_features = out
    return flops, params


def _interaction_shape(workload: Workload) -> tuple[int, int]:
    """(F, D): the interaction's vectors (the bottom MLP's output and one per table) and
    their width."""
    width = workload.bottom_mlp[-1] if workload.bottom_mlp else workload.dense_in_features
    return len(workload.tables) + 1, width


def _interaction_flops_per_sample(workload: Workload) -> float:
    """Forward flops of the dot interaction of the F vectors of D dims: 2·F²·D."""
    features, width = _interaction_shape(workload)
    return 2.0 * features * features * width


def dense_flops_per_sample(workload: Workload) -> float:
    """Forward flops of DLRM's dense part per sample: bottom MLP, dot interaction of the
    F = tables + 1 vectors, top MLP over the dense vector and the F(F-1)/2 dot products."""
    features, width = _interaction_shape(workload)
    bottom, _ = _mlp(workload.dense_in_features, workload.bottom_mlp)
    top, _ = _mlp(width + features * (features - 1) // 2, workload.top_mlp)
    return bottom + _interaction_flops_per_sample(workload) + top


def dense_parameter_bytes(workload: Workload) -> float:
    """Bytes of the MLPs' parameters (= their gradient, all-reduced every step)."""
    features, width = _interaction_shape(workload)
    _, bottom = _mlp(workload.dense_in_features, workload.bottom_mlp)
    _, top = _mlp(width + features * (features - 1) // 2, workload.top_mlp)
    return (bottom + top) * workload.dtype_bytes


def dense_layers(workload: Workload) -> list[tuple[int, int]]:
    """(inputs, outputs) per sample of each dense layer: the bottom MLP's, the interaction's
    (its index is `len(workload.bottom_mlp)`), the top MLP's."""
    features, width = _interaction_shape(workload)
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


def interaction_s(workload: Workload, topology: Topology) -> float | None:
    """DLRM's dot interaction, forward + backward over the rank's batch, at the topology's
    measured costs: B·(F·D·`interaction_s_per_element` + F²·`interaction_s_per_pair`) for
    the F = tables + 1 vectors of D dims; None where the topology measures none (it is then
    priced as a dense layer)."""
    if topology.interaction_s_per_element is None:
        return None
    features, width = _interaction_shape(workload)
    per_sample = (
        features * width * topology.interaction_s_per_element
        + features * features * topology.interaction_s_per_pair
    )
    return workload.batch_size_per_rank * per_sample


def dense_compute_s(workload: Workload, topology: Topology) -> float:
    """Forward + backward (3x forward) of the dense part over the rank's batch, with the
    layers' fixed cost and activation traffic where the topology measures them, and the
    interaction at its own measured cost where the topology has one (`interaction_s`)."""
    batch = workload.batch_size_per_rank
    layers = dense_layers(workload)  # each one's overhead is priced, the interaction's too
    streamed = layers  # the layers whose flops and activations are priced at the rates
    flops = dense_flops_per_sample(workload)
    interaction = interaction_s(workload, topology)
    if interaction is not None:  # its flops and activations are in its own measured cost
        flops -= _interaction_flops_per_sample(workload)
        streamed = [layer for i, layer in enumerate(layers) if i != len(workload.bottom_mlp)]
    seconds = 3 * flops * batch / topology.dense_flops_per_s + (interaction or 0.0)
    seconds += len(layers) * topology.dense_layer_overhead_s
    if topology.dense_activation_bytes_per_s:
        elements = sum(ACTIVATION_IN_PASSES * i + ACTIVATION_OUT_PASSES * o for i, o in streamed)
        seconds += batch * elements * workload.dtype_bytes / topology.dense_activation_bytes_per_s
    return seconds


def all_reduce_s(num_bytes: float, topology: Topology) -> float:
    """Hierarchical all-reduce of `num_bytes` over every rank (0 on one rank)."""
    return _collective_s(_all_reduce_links_s, num_bytes, topology)


def all_reduce_rows_s(num_bytes: np.ndarray, topology: Topology) -> np.ndarray:
    """`all_reduce_s` of each of `num_bytes` [K], equal to the bit to it."""
    return _collective_rows_s(_all_reduce_links_s, num_bytes, topology)


def _all_reduce_links_s(num_bytes: np.ndarray | float, topology: Topology) -> np.ndarray | float:
    """A hierarchical all-reduce's time on the links, its latency aside."""
    per_node = min(topology.ranks_per_node, topology.world_size)
    nodes = topology.num_nodes
    intra = 2 * (per_node - 1) / per_node * num_bytes / topology.intra_node_bw_bytes_per_s
    inter = 2 * (nodes - 1) / nodes * num_bytes / per_node / topology.inter_node_bw_bytes_per_s
    return intra + inter


def all_gather_s(num_bytes: float, topology: Topology) -> float:
    """All-gather of `num_bytes` from every rank to every rank (0 on one rank): each rank
    receives them from the other ranks of its node over NVLink and from every rank of the other
    nodes over its NIC, as the all-to-all's links are priced."""
    return _collective_s(_all_gather_links_s, num_bytes, topology)


def all_gather_rows_s(num_bytes: np.ndarray, topology: Topology) -> np.ndarray:
    """`all_gather_s` of each of `num_bytes` [K], equal to the bit to it."""
    return _collective_rows_s(_all_gather_links_s, num_bytes, topology)


def _all_gather_links_s(num_bytes: np.ndarray | float, topology: Topology) -> np.ndarray | float:
    """An all-gather's time on the links, its latency aside."""
    per_node = min(topology.ranks_per_node, topology.world_size)
    intra = (per_node - 1) * num_bytes / topology.intra_node_bw_bytes_per_s
    inter = (topology.world_size - per_node) * num_bytes / topology.inter_node_bw_bytes_per_s
    return intra + inter


def _collective_s(links: Callable, num_bytes: float, topology: Topology) -> float:
    """A collective of `num_bytes`: its `links` time and its latency; 0 where nothing moves."""
    if topology.world_size == 1 or num_bytes <= 0:
        return 0.0
    return links(num_bytes, topology) + sync_latency_s(topology)


def _collective_rows_s(links: Callable, num_bytes: np.ndarray, topology: Topology) -> np.ndarray:
    """`_collective_s` of each of `num_bytes` [K], equal to the bit to it."""
    if topology.world_size == 1:
        return np.zeros(np.shape(num_bytes))
    return np.where(num_bytes > 0, links(num_bytes, topology) + sync_latency_s(topology), 0.0)


def sync_latency_s(topology: Topology) -> float:
    """Latency of a collective the ranks enter from their own computation (outputs,
    all-reduces): `Topology.sync_latency_s`, at least the network's."""
    return max(topology.network_latency_s, topology.sync_latency_s or 0.0)
