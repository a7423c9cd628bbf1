"""`python -m distcache calibrate`: measure this machine and write a `Topology` JSON.

Each measurement is a small function returning one number (or one fit), so each can be tested
and re-used on its own (one rank's compute in `distcache.tools.microbench` and, for the dense part,
`distcache.tools.densebench`, run in order by `distcache.tools.compute_figures`; the network in
`distcache.tools.network`; all re-exported here):

- `measure_copy_bandwidth`: bytes/s of a large tensor copy on the compute device.
- `measure_host_to_device_bandwidth`, `measure_device_to_host_bandwidth`: bytes/s between
  pinned host memory and the GPU, each way (CUDA only).
- `measure_lookup_costs`: a training step of distcache's cache kernel (look-ahead window,
  every row resident, power-law ids), timed at two batch sizes and two widths and fitted as
  `seconds = fixed + row accesses / rows_per_s + bytes / bytes_per_s`, row accesses and bytes
  counted as the cost model counts them (2 per id, 2 per distinct row); the fixed part is the
  kernel's share of `sharding_overhead_s`, measured below with the rest of the framework. The
  same fit for TorchRec's fused kernel (FBGEMM's), which serves device-stored tables
  (`device_lookup_rows_per_s`; skipped, with a note, where FBGEMM has no kernel here).
- `measure_dense_flops`: achieved FLOP/s of a wide MLP forward + backward (compute-bound).
- `measure_dense_layer_overhead`: seconds per layer of an MLP too small to compute anything
  (forward, backward, SGD update): the dispatch cost of a layer (on a GPU, of its launches).
- `measure_activation_bandwidth`: bytes/s of the memory-bound activation traffic of a narrow,
  deep MLP on a large batch, once its flops and layer overheads are taken out.
- `measure_interaction_costs`: DLRM's dot interaction forward + backward at several (vectors,
  dims) shapes, fitted per sample as seconds per element of its vectors plus per entry of
  their products (small batched matmuls, far below the MLP's FLOP/s on a CPU).
- `measure_staging_costs`: what a partial cache's misses add to a step, fitted as bytes
  moved (loads and write-backs, with the scheduler's work per row: the host-to-device rate
  on CPU) plus the slots it scores once per batch to pick victims (`cache_scan_rows_per_s`,
  the pricing of the scheduler where the next figures are missing).
- `measure_schedule_costs`: the look-ahead scheduler alone (`distcache.tools.schedbench`),
  on power-law batches of a few sizes and caches of a few capacities, fitted per batch as
  `fixed + ids·s_per_id + candidates·s_per_candidate`: the planner prices a look-ahead
  cache's scheduler from the last two instead of `cache_scan_rows_per_s`.
- `measure_collectives`: gloo all-to-all, all-reduce, reduce-scatter and all-gather between
  the local ranks, fitted as `time = latency + bytes / bandwidth` over several message sizes
  (the last two are what TorchRec's row-wise outputs take); `measure_sync_latency`:
  what a collective costs between compute bursts, when peers compete for the cores.
- `distcache.tools.framework_costs.measure_framework_costs`: tiny DLRM plans trained for real
  under TorchRec's DMP on a one-rank group, giving the framework's fixed costs per step, per
  sharding type, per bag routed and per bag of a table with hot rows, and the bytes/s of a
  data-parallel table's dense update.

`calibrate` runs them all and `topology_from` (`measurements.py`) turns the results into a
`Topology`, with the machine, the date and what could not be measured in
`Topology.calibration`. On CPU the
compute measurements run in every rank at once (each with its share of the cores), as the
ranks of a job compete for cores and memory; each figure is the mean over ranks. On CPU the
"device" is host memory: device and host memory are the same pool (each is MemAvailable /
ranks; a planner must not fill both). On one machine the inter-node figures equal the
intra-node ones; one rank has no network to measure, so its figures are the preset's (CPU's,
or on CUDA the GPU presets' NVLink and NIC). The network is measured with gloo over host
tensors on CUDA machines too (an NCCL measurement needs one GPU per rank); there only rank 0
measures compute.

On CUDA (`--device cuda`, sizes `CUDA_FULL` / `CUDA_QUICK`: batches large enough that the
device's work, not the launches, sets each fitted slope), every `Topology` figure the cost
model reads on a GPU comes from a measurement on `cuda:0`, each CUDA timing synchronized
(`microbench.median_seconds`: CUDA events; the lookups and the scheduler: the device's work
alone, `devicetime`, after the warm-up calls that capture a cache's graphs; the staging and
framework steps: `torch.cuda.synchronize` around each):

- `device_memory_bytes`: free device memory less `HBM_RESERVE_FRACTION` (CUDA context, dense
  model, activations); `host_memory_bytes`: MemAvailable / ranks.
- `device_memory_bw_bytes_per_s`: 2 x a device-to-device copy's bytes/s.
- `host_to_device_bw_bytes_per_s`, `device_to_host_bw_bytes_per_s`: copies from and to pinned
  host memory (a cache's loads, its write-backs); `host_to_device_latency_s`: a 4-byte one.
- `lookup_rows_per_s`, `lookup_bytes_per_s`: distcache's cache kernel, fitted;
  `device_lookup_rows_per_s`, `device_lookup_bytes_per_s`: FBGEMM's TBE (its CUDA build),
  fitted, or none, with a note (device tables then at distcache's rates).
- `reactive_cache_s_per_id`, `_per_miss`: FBGEMM's UVM cache (TorchRec's `fused_uvm_caching`)
  against its every-row-in-HBM kernel, per id and per row it loads
  (`uvmbench.measure_uvm_cache_costs`; CUDA only);
- `schedule_s_per_id`, `schedule_s_per_candidate`: `measure_schedule_costs`;
  `cache_scan_rows_per_s`: `measure_staging_costs`' per-slot part.
- `dense_flops_per_s`: a wide MLP; `dense_layer_overhead_s`: a 4-wide one, the launches of a
  layer's forward, backward and update; `dense_activation_bytes_per_s`: a narrow one on a
  large batch; `interaction_s_per_element`, `interaction_s_per_pair`: DLRM's interaction at
  five shapes.
- `step_overhead_s`, `sharding_overhead_s`, `id_overhead_s`, `hot_bag_overhead_s`,
  `dense_update_bytes_per_s`: `measure_framework_costs` under TorchRec's DMP on one GPU (a
  one-rank NCCL group). It needs TorchRec and FBGEMM's CUDA build; without them these keep
  the preset's values (no overheads, the update at HBM bandwidth over 4 passes) and
  `Topology.calibration` says so.
- the network (`intra_node_bw_bytes_per_s` to `sync_latency_s`): gloo between `--ranks` local
  ranks; on one rank, with nothing to measure, the GPU presets' NVLink and NIC.

Not measured, from `--ranks`: `world_size`, `ranks_per_node`. A fit the noise leaves
non-positive gives None (its default prices the term) and a note in `calibration`; on CUDA
the stager's own rate (`measure_staging_costs`' bytes/s) is reported, not priced: with a
batch staged ahead its copies overlap the step they are timed in, so what they add to it is
their exposed part, which the cost model derives itself from the link's rates.

Time: with `--quick` a few seconds on CPU (one rank); on one GPU an estimated 30-60 s (CUDA
and NCCL start-up, and the framework's twelve tiny DMP plans, each built and captured anew),
within the 80-90 s `benchmarks/gpu_session.sh quick` gives it; in full, minutes on either.

Example::

    python -m distcache calibrate --ranks 2 --out topology.json
    python -m distcache calibrate --device cuda --ranks 1 --quick --out gpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distcache.errors import DistcacheConfigError
from distcache.job.distributed import run_ranks, single_rank_group
from distcache.planner.topology import HBM_RESERVE_FRACTION
from distcache.tools.compute_figures import Figures, compute_figures, progress
from distcache.tools.densebench import (
    measure_activation_bandwidth,
    measure_dense_flops,
    measure_dense_layer_overhead,
    measure_interaction_costs,
)
from distcache.tools.framework_costs import FrameworkCosts, measure_framework_costs
from distcache.tools.machine import cuda_missing, describe
from distcache.tools.measure import MeasureOptions
from distcache.tools.measurements import Measurements, summary, topology_from
from distcache.tools.microbench import (
    CUDA_FULL,
    CUDA_QUICK,
    FULL,
    QUICK,
    CalibrationSizes,
    LookupCosts,
    StagingCosts,
    measure_copy_bandwidth,
    measure_copy_latency,
    measure_device_to_host_bandwidth,
    measure_host_to_device_bandwidth,
    measure_lookup_costs,
    measure_staging_costs,
    sizes_for,
)
from distcache.tools.network import (
    LinkFit,
    fit_latency_bandwidth,
    measure_collectives,
    measure_sync_latency,
)
from distcache.tools.plan_cli import output_file
from distcache.tools.schedbench import ScheduleCosts, measure_schedule_costs

__all__ = [
    "CUDA_FULL",
    "CUDA_QUICK",
    "FULL",
    "QUICK",
    "CalibrationSizes",
    "LinkFit",
    "ScheduleCosts",
    "Measurements",
    "calibrate",
    "LookupCosts",
    "StagingCosts",
    "fit_latency_bandwidth",
    "main",
    "measure_activation_bandwidth",
    "measure_collectives",
    "measure_copy_bandwidth",
    "measure_copy_latency",
    "measure_dense_flops",
    "measure_dense_layer_overhead",
    "measure_device_to_host_bandwidth",
    "measure_host_to_device_bandwidth",
    "measure_interaction_costs",
    "measure_lookup_costs",
    "measure_schedule_costs",
    "measure_staging_costs",
    "measure_sync_latency",
    "sizes_for",
    "topology_from",
]


def _mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (free pages where that file is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


_FRAMEWORK_FIGURES = tuple(f.name for f in dataclasses.fields(FrameworkCosts))


def _framework(
    device: str, world: int, threads: int, sizes: CalibrationSizes, figures: Figures
) -> tuple[Figures, list[str]]:
    """The framework's costs (`measure_framework_costs`), priced with the rates in `figures`,
    on a one-rank group of this process (TorchRec's plans name global ranks; NCCL on CUDA,
    which needs TorchRec and FBGEMM's CUDA build: without them, none, and a note)."""
    kept = f"{', '.join(_FRAMEWORK_FIGURES)} keep the preset's values"
    missing = cuda_missing() if device == "cuda" else None
    if missing:
        return {}, [f"framework costs not measured ({missing}): {kept}"]
    options = MeasureOptions(
        steps=sizes.framework_steps, warmup=sizes.framework_warmup, threads=threads
    )
    rates = topology_from(_measurements(device, world, threads, [figures], {}), name="x")
    notes = []

    def measure(data_parallel: bool) -> FrameworkCosts:
        what = f"the framework's costs ({'with' if data_parallel else 'without'} DP plans)"
        with single_rank_group("nccl" if device == "cuda" else "gloo"), progress(what):
            return measure_framework_costs(
                rates, big_rows=sizes.framework_rows, big_batch=sizes.framework_batch,
                options=options, device=device, data_parallel=data_parallel,
            )  # fmt: skip

    try:
        costs = measure(True)
    except Exception as error:  # noqa: BLE001
        if device != "cuda":
            raise
        # On a GPU the other figures are kept: a scarce GPU session loses only these. Where
        # TorchRec's data-parallel kernel cannot run (an FBGEMM build without it), the rest
        # is measured without it.
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        try:
            costs = measure(False)
        except Exception:  # noqa: BLE001
            return {}, [f"framework costs failed ({reason}): {kept}"]
        measured = dataclasses.asdict(costs)
        del measured["dense_update_bytes_per_s"]  # (absent: the preset's value stands)
        note = f"the data-parallel plans failed ({reason}): dense_update_bytes_per_s keeps "
        return measured, [note + "the preset's value, sharding_overhead_s from row-wise alone"]
    if costs.dense_update_bytes_per_s is None:
        notes.append("the dense update lost in the noise: priced at device memory bandwidth")
    return dataclasses.asdict(costs), notes


@dataclass(frozen=True, kw_only=True)
class _RankResult:
    """What one rank of `calibrate` measured."""

    figures: Figures
    """`Measurements` fields."""
    links: dict[str, LinkFit]
    """'all_to_all', 'all_reduce', 'reduce_scatter', 'all_gather' (none on one rank)."""
    notes: list[str]
    """What this rank could not measure."""


def _calibration_worker(
    rank: int, world: int, device: str, sizes: CalibrationSizes, threads: int
) -> _RankResult:
    """One rank of `calibrate`: compute (all ranks at once on CPU, rank 0 on CUDA), the
    collectives, then the framework's costs on a one-rank process group of its own (all
    ranks again at once on CPU, rank 0 on CUDA)."""
    measures = device == "cpu" or rank == 0
    dist.barrier()
    figures, notes = compute_figures(device, sizes) if measures else ({}, [])
    dist.barrier()
    links: dict[str, LinkFit] = {}
    if world > 1:
        links = measure_collectives(sizes.message_bytes)
        figures["sync_latency_s"] = measure_sync_latency(repeats=4 * sizes.repeats)
    dist.destroy_process_group()
    if measures:
        framework, more = _framework(device, world, threads, sizes, figures)
        figures |= framework
        notes += more
    return _RankResult(figures=figures, links=links, notes=notes)


def _measurements(
    device: str,
    ranks: int,
    threads: int,
    per_rank: list[Figures],
    links: dict[str, LinkFit],
    seconds: float = 0.0,
    notes: Sequence[str] = (),
) -> Measurements:
    """The mean over ranks of each measured figure (None where a rank measured none)."""
    fields = {f.name for f in dataclasses.fields(Measurements)}

    def mean(name: str) -> float | None:
        values = [r[name] for r in per_rank if r.get(name) is not None]
        return statistics.mean(values) if values else None

    measured = {name: mean(name) for name in per_rank[0] if name in fields}
    host_memory = _mem_available_bytes() // ranks
    device_memory = host_memory
    if device == "cuda":
        torch.cuda.empty_cache()  # the measurements' blocks, which the allocator keeps
        device_memory = int(torch.cuda.mem_get_info()[0] * (1 - HBM_RESERVE_FRACTION))
    return Measurements(
        device=device,
        ranks=ranks,
        threads_per_rank=threads,
        all_to_all=links.get("all_to_all"),
        all_reduce=links.get("all_reduce"),
        reduce_scatter=links.get("reduce_scatter"),
        all_gather=links.get("all_gather"),
        device_memory_bytes=device_memory,
        host_memory_bytes=host_memory,
        machine=describe(device),
        notes=tuple(dict.fromkeys(notes)),  # once each, in order (every CPU rank notes them)
        seconds=seconds,
        **measured,
    )


def calibrate(
    *,
    ranks: int = 2,
    device: str = "cpu",
    sizes: CalibrationSizes | None = None,
    timeout_s: float = 300,
    threads: int | None = None,
) -> Measurements:
    """Measure this machine as seen by one of `ranks` ranks.

    On CPU every rank measures at once with `threads` threads (default `cpu_count // ranks`,
    its share when all ranks train at once); the figures are the means over ranks. Calibrate
    with the threads the jobs will train with: on shared cores more threads than free cores
    make OpenMP spin, and every rate collapses. On CUDA rank 0 measures `cuda:0`.

    Args:
        ranks: Ranks on this machine (1 measures no network: the preset's figures stand in).
        device: 'cpu' or 'cuda'.
        sizes: Problem sizes (default `sizes_for(device, quick=False)`).
        timeout_s: Deadline of the whole calibration.
        threads: Torch threads per rank on CPU.
    """
    if device not in ("cpu", "cuda"):
        raise DistcacheConfigError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if ranks < 1:
        raise DistcacheConfigError(f"ranks must be >= 1, got {ranks}")
    if not timeout_s > 0:  # NaN too
        raise DistcacheConfigError(f"timeout must be > 0 seconds, got {timeout_s}")
    if device == "cuda" and not torch.cuda.is_available():
        raise DistcacheConfigError("device 'cuda' asked for, but torch sees no CUDA device")
    start = time.perf_counter()
    if threads is not None and threads < 1:
        raise DistcacheConfigError(f"threads must be >= 1, got {threads}")
    sizes = sizes or sizes_for(device, quick=False)
    threads = threads or max(1, (os.cpu_count() or 1) // ranks)
    threads = threads if device == "cpu" else torch.get_num_threads()
    per_rank = run_ranks(
        _calibration_worker,
        ranks,
        args=(device, sizes, threads),
        timeout_s=timeout_s,
        env={"OMP_NUM_THREADS": str(threads)},
        alone_in_process=True,
    )
    figures = [r.figures for r in per_rank]
    notes = [note for r in per_rank for note in r.notes]
    seconds = time.perf_counter() - start
    return _measurements(device, ranks, threads, figures, per_rank[0].links, seconds, notes)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m distcache calibrate`; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m distcache calibrate", description="Measure this machine as a Topology."
    )
    parser.add_argument("--out", type=output_file, help="JSON file to write (default: stdout)")
    parser.add_argument("--ranks", type=int, default=2, help="local ranks (default 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes (tests, smoke runs)")
    parser.add_argument("--name", help="topology name (default: calibrated-DEVICE-xRANKS)")
    parser.add_argument("--timeout", type=float, default=300.0, help="deadline, s")
    parser.add_argument("--threads", type=int, help="torch threads per rank (default cpus/ranks)")
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        m = calibrate(
            ranks=args.ranks,
            device=args.device,
            sizes=sizes_for(args.device, quick=args.quick),
            timeout_s=args.timeout,
            threads=args.threads,
        )
    except DistcacheConfigError as e:
        print(f"calibrate: {e}", file=sys.stderr)
        return 2
    topology = topology_from(m, name=args.name or f"calibrated-{args.device}-x{args.ranks}")
    text = json.dumps(topology.to_dict(), indent=2) + "\n"
    if args.out:
        try:
            args.out.write_text(text)
        except OSError as e:  # the measurement is not lost: the topology goes to stdout
            sys.stdout.write(text)
            print(summary(m), file=sys.stderr)
            print(f"calibrate: cannot write --out {args.out} ({e}); printed it", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    print(summary(m), file=sys.stderr)
    return 0
