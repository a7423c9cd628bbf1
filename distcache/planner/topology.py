"""Hardware descriptions for the planner: presets, byte-size parsing, and topology JSON files.

A `Topology` (see `types.py`) holds per-rank capacities and rates. The presets below are
*modelling assumptions*, not measurements: each number is documented where it is set (the GPU
presets price no launch or host time per step). For the machine at hand, `python -m distcache
calibrate` (`--device cuda` for its GPU) measures the rates, the machine and date in
`Topology.calibration`, and saves `Topology.to_dict()` as JSON, which `load_topology` reads
back.

Example::

    topology = preset("h100", world_size=16, device_memory_bytes=parse_bytes("16GB"))
    save_topology(topology, "h100x16.json")
    assert load_topology("h100x16.json") == topology
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from distcache.errors import DistcacheConfigError
from distcache.planner.types import Topology

PRESETS = ("h100", "h200", "cpu")

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_FORMS = (
    "an int, or text like '16GB', '512MiB', '1.5TB', '1e9' "
    "(units B, KB, MB, GB, TB: 1000^k; KiB, MiB, GiB, TiB: 1024^k)"
)

GB = 10**9
GiB = 2**30

# Fraction of HBM left out of `device_memory_bytes` by default: CUDA context and NCCL buffers
# (~1-2 GB), the dense model with its optimizer state and activations, all-to-all buffers for
# pooled embeddings, and allocator fragmentation. TorchRec's planner reserves a similar share.
HBM_RESERVE_FRACTION = 0.15
# Host memory: 2 TB per 8-GPU node, 10 % kept for the OS, the data loader and pinned staging
# buffers; the rest split evenly over the node's ranks.
_HOST_BYTES_PER_NODE = 2 * 10**12
_HOST_RESERVE_FRACTION = 0.10
_GPUS_PER_NODE = 8

# Link rates per rank and direction (nominal; NCCL reaches ~80-90 % of them on large messages).
_NVLINK4_BYTES_PER_S = 450e9  # NVLink 4 through NVSwitch: 900 GB/s bidirectional per GPU
_NIC_400G_BYTES_PER_S = 50e9  # one 400 Gb/s InfiniBand/RoCE NIC per GPU (rail-optimized)
_PCIE5_ACHIEVED_BYTES_PER_S = 50e9  # PCIe Gen5 x16 (64 GB/s raw), pinned-memory copies
# Dense MLPs: 40 % of the dense TF32 tensor-core peak (494.7 TFLOP/s on H100/H200 SXM; the two
# share one GH100 die and clocks). DLRM's MLPs are small (a few thousand wide), so much of the
# peak is lost to launch overhead and memory-bound layers; 40 % is a common achieved figure for
# large batches and an optimistic one for small batches.
_DENSE_ACHIEVED_FLOPS_PER_S = 0.40 * 494.7e12

_GPU_SPECS = {
    # name: (HBM bytes as reported by the driver, HBM bandwidth bytes/s)
    "h100": (80 * GiB, 3.35e12),  # H100 SXM 80 GB, HBM3
    "h200": (141 * GiB, 4.8e12),  # H200 SXM 141 GB, HBM3e
}


def parse_bytes(value: int | str) -> int:
    """A byte count from an int or a size text.

    Args:
        value: a non-negative int, or text such as "16GB" (10^9), "512MiB" (2^20), "1e9",
            "1.5 TB". Units are case-insensitive.

    Returns:
        The number of bytes, rounded down to an int.

    Example::

        assert parse_bytes("16GB") == 16_000_000_000 and parse_bytes("1KiB") == 1024
    """
    if isinstance(value, bool):
        raise DistcacheConfigError(f"byte size {value!r} is a bool; give {_FORMS}")
    if isinstance(value, int):
        if value < 0:
            raise DistcacheConfigError(f"byte size {value} is negative; give {_FORMS}")
        return value
    if not isinstance(value, str):
        raise DistcacheConfigError(
            f"byte size {value!r} has type {type(value).__name__}; give {_FORMS}"
        )
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise DistcacheConfigError(f"cannot read byte size {value!r}; give {_FORMS}")
    size = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(size):
        raise DistcacheConfigError(f"byte size {value!r} is not finite; give {_FORMS}")
    return int(size)


def preset(
    name: str,
    *,
    world_size: int,
    device_memory_bytes: int | str | None = None,
    ranks_per_node: int | None = None,
) -> Topology:
    """A documented hardware preset with `world_size` ranks.

    'h100' / 'h200': 8 GPUs per node (SXM, NVSwitch). Per GPU: NVLink 450 GB/s per direction
    within a node, one 400 Gb/s NIC (50 GB/s) across nodes, PCIe Gen5 at 50 GB/s achieved for
    host-device copies, HBM3 3.35 TB/s (H100 80 GB) or HBM3e 4.8 TB/s (H200 141 GB); dense MLPs
    at 40 % of the TF32 dense peak (~198 TFLOP/s). Embeddings get the HBM minus a 15 % reserve
    (CUDA context, NCCL, dense model, activations, fragmentation) unless `device_memory_bytes`
    is given; host memory is 2 TB per node less 10 %, split over its ranks (225 GB per rank).

    'cpu': a small shared machine like the one distcache's tests run on (2 cores, ~20 GB RAM),
    every rank on one node and "device" memory being host memory: 4 GB for embeddings and
    their caches, 8 GB host store, ~5 GB/s gathers, ~3 GB/s store-to-cache copies, ~1 GB/s
    between ranks on a node (gloo's TCP transport over loopback, bound by the CPU's copies),
    the same 1 GB/s across nodes (a 10 GbE NIC carries 1.25 GB/s, but gloo crosses it through
    the same CPU-bound TCP stack, so inter-node never beats intra-node), 50 GFLOP/s dense.
    Run `python -m distcache calibrate` for measured numbers.

    Args:
        name: one of PRESETS.
        world_size: number of ranks.
        device_memory_bytes: override of the per-rank memory for embeddings (int or "16GB").
        ranks_per_node: override of the ranks per node (default 8 for GPUs, `world_size` on
            CPU; at most `world_size`).

    Example::

        topology = preset("h100", world_size=64, device_memory_bytes="16GB")
    """
    if name not in PRESETS:
        raise DistcacheConfigError(f"unknown topology preset {name!r}; allowed: {list(PRESETS)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise DistcacheConfigError(f"world_size must be an int >= 1, got {world_size!r}")
    memory = None if device_memory_bytes is None else parse_bytes(device_memory_bytes)
    if name == "cpu":
        return _cpu(world_size, memory, ranks_per_node)
    return _gpu(name, world_size, memory, ranks_per_node)


def _gpu(name: str, world_size: int, memory: int | None, ranks_per_node: int | None) -> Topology:
    hbm_bytes, hbm_bw = _GPU_SPECS[name]
    per_node = min(ranks_per_node or _GPUS_PER_NODE, world_size)
    host_per_rank = int(_HOST_BYTES_PER_NODE * (1 - _HOST_RESERVE_FRACTION)) // _GPUS_PER_NODE
    return Topology(
        name=f"{name}x{world_size}",
        world_size=world_size,
        ranks_per_node=per_node,
        compute_device="cuda",
        device_memory_bytes=(
            memory if memory is not None else int(hbm_bytes * (1 - HBM_RESERVE_FRACTION))
        ),
        host_memory_bytes=host_per_rank,
        device_memory_bw_bytes_per_s=hbm_bw,
        host_to_device_bw_bytes_per_s=_PCIE5_ACHIEVED_BYTES_PER_S,
        host_to_device_latency_s=10e-6,
        intra_node_bw_bytes_per_s=_NVLINK4_BYTES_PER_S,
        inter_node_bw_bytes_per_s=_NIC_400G_BYTES_PER_S,
        network_latency_s=20e-6,
        dense_flops_per_s=_DENSE_ACHIEVED_FLOPS_PER_S,
    )


# CPU ranks talk through gloo's TCP transport: on one node over loopback, bound by the CPU's
# copies; across nodes through the same stack and a NIC, so never faster than on one node.
_GLOO_LOOPBACK_BYTES_PER_S = 1e9
_NIC_10G_BYTES_PER_S = 1.25e9  # 10 GbE


def _cpu(world_size: int, memory: int | None, ranks_per_node: int | None) -> Topology:
    return Topology(
        name=f"cpux{world_size}",
        world_size=world_size,
        ranks_per_node=min(ranks_per_node or world_size, world_size),
        compute_device="cpu",
        device_memory_bytes=memory if memory is not None else 4 * GB,
        host_memory_bytes=8 * GB,
        device_memory_bw_bytes_per_s=5e9,  # random row gathers, 2 cores
        host_to_device_bw_bytes_per_s=3e9,  # host store -> cache: gather + copy
        host_to_device_latency_s=2e-6,
        intra_node_bw_bytes_per_s=_GLOO_LOOPBACK_BYTES_PER_S,
        inter_node_bw_bytes_per_s=min(_NIC_10G_BYTES_PER_S, _GLOO_LOOPBACK_BYTES_PER_S),
        network_latency_s=50e-6,
        dense_flops_per_s=50e9,
    )


def save_topology(topology: Topology, path: str | Path) -> None:
    """Write `topology` as JSON (`Topology.to_dict()`), readable by `load_topology`.

    Args:
        topology: the topology to save.
        path: the JSON file to write.
    """
    Path(path).write_text(json.dumps(topology.to_dict(), indent=2) + "\n")


def load_topology(path: str | Path) -> Topology:
    """Read a topology JSON written by `save_topology` or `python -m distcache calibrate`.

    Unknown keys are an error (see `Topology.from_dict`).

    Args:
        path: the JSON file.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise DistcacheConfigError(f"cannot read topology {str(path)!r}: {error}") from error
    if not isinstance(data, dict):
        raise DistcacheConfigError(f"topology {str(path)!r} must hold a JSON object")
    return Topology.from_dict(data)
