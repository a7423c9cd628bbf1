"""What this machine offers `measure` and `calibrate`: its memory, whether plans can run on its
GPU, and a line naming it."""

from __future__ import annotations

import datetime
import os
import platform

import torch

from distcache.planner.types import Topology, Workload


def cuda_topology_reason(workload: Workload, topology: Topology, plans: int) -> str | None:
    """Why plans on `topology` cannot be measured on this machine's GPU, or None: a CUDA
    topology of one rank, and `plans` copies of every table's rows (each plan keeps its own)
    within this machine's memory."""
    if topology.compute_device != "cuda":
        return f"topology {topology.name} is a {topology.compute_device} topology, not a CUDA one"
    if topology.world_size != 1:
        return (
            f"topology {topology.name} has {topology.world_size} ranks; on CUDA this machine "
            "runs one (--world-size 1)"
        )
    rows = sum(workload.row_bytes(t) * t.rows for t in workload.tables)
    memory = machine_memory_bytes()
    if plans * rows > memory:
        return (
            f"the tables' rows take {rows / 1e9:.1f} GB of host memory per plan, "
            f"{plans * rows / 1e9:.1f} GB for {plans}, and this machine has {memory / 1e9:.1f} GB"
        )
    return None


def machine_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def describe(device: str) -> str:
    """This machine in one line, with the UTC date: host, the device (the GPU's name on
    CUDA, else the CPU's model) and torch's version."""
    name = torch.cuda.get_device_name() if device == "cuda" else cpu_model()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"{platform.node()}, {name}, torch {torch.__version__}, {date}"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows of it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cuda_missing() -> str | None:
    """What this machine lacks to measure plans on CUDA, in one line, or None: a CUDA device,
    TorchRec, and FBGEMM's CUDA build (TorchRec's kernels on the GPU)."""
    if not torch.cuda.is_available():
        return f"no CUDA device here (torch {torch.__version__}, torch.cuda.is_available() False)"
    try:
        import fbgemm_gpu
        import torchrec  # noqa: F401
    except ImportError as error:
        return f"TorchRec and FBGEMM are needed on CUDA ({error})"

    if getattr(fbgemm_gpu, "__variant__", None) == "cpu":
        return (
            f"FBGEMM here is its CPU build (fbgemm_gpu {fbgemm_gpu.__version__}); TorchRec's "
            "kernels on CUDA need its CUDA build"
        )
    return None
