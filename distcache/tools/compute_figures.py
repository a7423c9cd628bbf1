"""One rank's compute figures for `python -m distcache calibrate`: the timed kernels of
`microbench`, `densebench` and `schedbench` run in order, each result under its
`measurements.Measurements` name, with a note for each figure the rank could not measure.

On CUDA the host link is timed both ways from pinned host memory; on CPU the stager's
measured rate is the host-to-device rate (`calibrate`'s module docstring has the list).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

from distcache.tools.densebench import (
    measure_activation_bandwidth,
    measure_dense_flops,
    measure_dense_layer_overhead,
    measure_interaction_costs,
)
from distcache.tools.microbench import (
    CalibrationSizes,
    measure_copy_bandwidth,
    measure_copy_latency,
    measure_device_to_host_bandwidth,
    measure_host_to_device_bandwidth,
    measure_lookup_costs,
    measure_staging_costs,
)
from distcache.tools.schedbench import measure_schedule_costs
from distcache.tools.uvmbench import measure_uvm_cache_costs

Figures = dict[str, float | None]
"""`Measurements` fields by name."""


@contextlib.contextmanager
def progress(what: str) -> Iterator[None]:
    """Say on stderr what was measured and in how long, as each measurement ends: a
    calibration cut by a time limit then shows where it was (on a GPU, where FBGEMM's UVM
    cache and TorchRec's plans take the longest)."""
    start = time.perf_counter()
    yield
    print(f"calibrate: {what} in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def compute_figures(device: str, s: CalibrationSizes) -> tuple[Figures, list[str]]:
    """This rank's compute measurements, and notes on those it could not make (a fit lost in
    the noise, FBGEMM's kernel missing).

    Args:
        device: 'cpu' or 'cuda'.
        s: Problem sizes (`microbench.sizes_for`).
    """
    repeats = s.repeats
    with progress("memory copy"):
        out: Figures = {
            "copy_bw_bytes_per_s": measure_copy_bandwidth(
                nbytes=s.copy_bytes, repeats=repeats, device=device
            )
        }
    notes = _lookups(device, s, out)
    with progress("dense compute"):
        flops = measure_dense_flops(
            batch=s.mlp_batch, widths=s.mlp_widths, repeats=repeats, device=device
        )
        out["dense_flops_per_s"] = flops
    with progress("interaction"):
        interaction = measure_interaction_costs(
            batch=s.interaction_batch, shapes=s.interaction_shapes, repeats=repeats, device=device
        )
    out["interaction_s_per_element"] = interaction.s_per_element
    out["interaction_s_per_pair"] = interaction.s_per_pair
    notes += _staging(device, s, out)
    with progress("dense layers"):
        layer = measure_dense_layer_overhead(repeats=repeats, device=device)
        out["dense_layer_overhead_s"] = layer
        out["dense_activation_bytes_per_s"] = measure_activation_bandwidth(
            batch=s.activation_batch, widths=s.activation_widths, flops_per_s=flops,
            layer_overhead_s=layer, repeats=repeats, device=device,
        )  # fmt: skip
    if out["dense_activation_bytes_per_s"] is None:
        notes.append("activation traffic lost in the noise: dense_flops_per_s covers it")
    return out, notes


def _lookups(device: str, s: CalibrationSizes, out: Figures) -> list[str]:
    """The lookup fits of distcache's kernel and of TorchRec's fused one (FBGEMM's) into
    `out`, and on CUDA FBGEMM's UVM cache's cost per id and per miss; a note where FBGEMM has
    no kernel here, or its cache could not be measured (or its misses told apart)."""
    kw = {"rows": s.lookup_rows, "dims": s.lookup_dims, "bags": s.lookup_bags}
    kw |= {"pooling": s.lookup_pooling, "alpha": s.lookup_alpha, "repeats": s.repeats}
    with progress("distcache's lookups"):
        lookup = measure_lookup_costs(**kw, device=device, kernel="distcache")
    out |= {"lookup_rows_per_s": lookup.rows_per_s, "lookup_bytes_per_s": lookup.bytes_per_s}
    try:
        with progress("FBGEMM's lookups"):
            fused = measure_lookup_costs(**kw, device=device, kernel="fused")
    except (ImportError, NotImplementedError) as error:  # no fbgemm_gpu; its CPU build on CUDA
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        return [f"FBGEMM's TBE not measured ({reason}): device tables at distcache's rates"]
    out["device_lookup_rows_per_s"] = fused.rows_per_s
    out["device_lookup_bytes_per_s"] = fused.bytes_per_s
    if device != "cuda":  # (FBGEMM's UVM cache is CUDA only)
        return []
    try:
        with progress("FBGEMM's UVM cache"):
            uvm = measure_uvm_cache_costs(
                rows=s.lookup_rows, dim=s.lookup_dims[-1], bags=s.lookup_bags,
                pooling=s.lookup_pooling, alpha=s.lookup_alpha, repeats=s.repeats,
            )  # fmt: skip
    except Exception as error:  # e.g. a packed FBGEMM build without its cache's kernels
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        return [f"FBGEMM's UVM cache not measured ({reason}): reactive caches priced by staging"]
    out["reactive_cache_s_per_id"] = uvm.s_per_id
    out["reactive_cache_s_per_miss"] = uvm.s_per_miss
    if uvm.s_per_id is None:
        return ["FBGEMM's UVM cache's cost lost in the noise: reactive caches priced by staging"]
    if uvm.s_per_miss is None:
        return ["FBGEMM's UVM cache's misses not told from its ids: priced per id alone"]
    return []


def _staging(device: str, s: CalibrationSizes, out: Figures) -> list[str]:
    """The host link and distcache's staging and scheduler into `out`: on CUDA the link's
    rate each way from pinned host memory; on CPU the stager's rate (the copy's where it is
    lost in the noise). Notes on the fits the noise lost."""
    repeats, notes = s.repeats, []
    out["host_to_device_latency_s"] = measure_copy_latency(device=device)
    with progress("distcache's staging"):
        staging = measure_staging_costs(
            rows=s.lookup_rows, dim=s.lookup_dims[0], bags=s.lookup_bags[-1],
            pooling=s.lookup_pooling, alpha=s.lookup_alpha, capacities=s.staging_capacities,
            repeats=repeats, device=device,
        )  # fmt: skip
    out["staging_bytes_per_s"] = staging.bytes_per_s
    out["cache_scan_rows_per_s"] = staging.scan_rows_per_s
    if device == "cuda":
        out["host_to_device_bw_bytes_per_s"] = measure_host_to_device_bandwidth(
            nbytes=s.copy_bytes, repeats=repeats
        )
        out["device_to_host_bw_bytes_per_s"] = measure_device_to_host_bandwidth(
            nbytes=s.copy_bytes, repeats=repeats
        )
    else:
        out["host_to_device_bw_bytes_per_s"] = staging.bytes_per_s or out["copy_bw_bytes_per_s"]
        if staging.bytes_per_s is None:
            notes.append("the stager's rate lost in the noise: host-device at the copy's rate")
    with progress("distcache's scheduler"):
        schedule = measure_schedule_costs(
            rows=s.schedule_rows, points=s.schedule_points, alpha=s.lookup_alpha,
            repeats=repeats, device=device,
        )  # fmt: skip
    if schedule is None:
        notes.append("the scheduler's fit lost in the noise: priced by cache_scan_rows_per_s")
    else:
        for cost, name in ((schedule.s_per_id, "per-id"), (schedule.s_per_candidate, "per-slot")):
            if cost == 0:
                notes.append(f"the scheduler's {name} cost lost in the noise: 0 (the other's fit)")
        out["schedule_s_per_id"] = schedule.s_per_id
        out["schedule_s_per_candidate"] = schedule.s_per_candidate
        out["schedule_s_per_batch"] = schedule.fixed_s
    return notes
