"""What `python -m distcache calibrate` measured (`Measurements`), the `Topology` it gives
(`topology_from`) and the lines it prints about it (`summary`). The measurements themselves
are `distcache.tools.calibrate`'s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from distcache.planner.topology import preset
from distcache.planner.types import Topology
from distcache.tools.network import LinkFit


@dataclass(frozen=True, kw_only=True)
class Measurements:
    """Raw results of `calibrate`, per rank (the mean over ranks on CPU)."""

    device: str
    ranks: int
    threads_per_rank: int
    copy_bw_bytes_per_s: float
    host_to_device_bw_bytes_per_s: float
    device_to_host_bw_bytes_per_s: float | None = None
    """CUDA only (a copy to pinned host memory); on CPU the stager's rate covers both ways."""
    host_to_device_latency_s: float
    staging_bytes_per_s: float | None = None
    """`measure_staging_costs`' bytes/s (None: lost in the noise); the host-to-device rate on
    CPU, reported only on CUDA (see the module docstring)."""
    lookup_rows_per_s: float
    lookup_bytes_per_s: float | None
    device_lookup_rows_per_s: float | None = None
    """TorchRec's fused kernel (FBGEMM's); None where FBGEMM has no kernel here."""
    device_lookup_bytes_per_s: float | None = None
    cache_scan_rows_per_s: float | None = None
    """None where the capacities measured did not tell scanning from moving (noise)."""
    schedule_s_per_id: float | None = None
    """`measure_schedule_costs`; None where not measured or lost in the noise."""
    schedule_s_per_candidate: float | None = None
    schedule_s_per_batch: float | None = None
    """The fit's fixed part: reported, not priced (`rates.scheduling_time_s`)."""
    reactive_cache_s_per_id: float | None = None
    """`uvmbench.measure_uvm_cache_costs` (CUDA with FBGEMM's CUDA build); None elsewhere."""
    reactive_cache_s_per_miss: float | None = None
    """Its figure per miss; None also where the noise did not tell it from the ids'."""
    dense_flops_per_s: float
    dense_layer_overhead_s: float
    dense_activation_bytes_per_s: float | None
    interaction_s_per_element: float | None = None
    interaction_s_per_pair: float = 0.0
    all_to_all: LinkFit | None
    """None on one rank (no network)."""
    all_reduce: LinkFit | None
    reduce_scatter: LinkFit | None = None
    """What row-wise outputs take forward (None on one rank), ..."""
    all_gather: LinkFit | None = None
    """... and backward."""
    sync_latency_s: float | None = None
    """`measure_sync_latency`; None on one rank."""
    device_memory_bytes: int
    host_memory_bytes: int
    step_overhead_s: float = 0.0
    sharding_overhead_s: float = 0.0
    id_overhead_s: float = 0.0
    hot_bag_overhead_s: float = 0.0
    dense_update_bytes_per_s: float | None = None
    """None where the framework's costs were not measured, or the update was lost in the noise."""
    machine: str = ""
    """`machine.describe`: host, device, torch, UTC date."""
    notes: tuple[str, ...] = ()
    """What could not be measured, and what prices it instead."""
    seconds: float = field(default=0.0, compare=False)
    """Wall time of the whole calibration."""


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


# The figures `topology_from` passes on as measured, under the same name in `Measurements` and
# `Topology` (the rates and the framework's overheads); it derives the others.
_AS_MEASURED = tuple(
    sorted(
        (_field_names(Measurements) & _field_names(Topology))
        - {"device_memory_bytes", "host_memory_bytes", "sync_latency_s"}
    )
)


def topology_from(m: Measurements, *, name: str) -> Topology:
    """The `Topology` of a calibrated machine.

    Device memory bandwidth is the copy's memory traffic (2x the bytes copied; on CUDA a
    device-to-device copy). The network figures are conservative: the lower bandwidth and the
    higher latency of all-to-all and all-reduce; the sync latency is what a collective costs
    between compute bursts (`measure_sync_latency`, contention included), at least that;
    without a network (one rank), the preset's of the device (CPU's; on CUDA the GPU
    presets'). Inter-node equals intra-node (one machine). `Topology.calibration` names the
    machine and date, and what could not be measured (`Measurements.notes`).
    """
    if m.all_to_all is not None and m.all_reduce is not None:
        bw = min(m.all_to_all.bw_bytes_per_s, m.all_reduce.bw_bytes_per_s)
        latency = max(m.all_to_all.latency_s, m.all_reduce.latency_s)
        inter_bw = bw
    else:
        unmeasured = preset("cpu" if m.device == "cpu" else "h100", world_size=1)
        bw, latency = unmeasured.intra_node_bw_bytes_per_s, unmeasured.network_latency_s
        inter_bw = unmeasured.inter_node_bw_bytes_per_s
    row_wise_slowdown, row_wise_latency = 1.0, 0.0
    if m.reduce_scatter is not None and m.all_gather is not None:  # forward, backward
        seconds_per_byte = 1 / m.reduce_scatter.bw_bytes_per_s + 1 / m.all_gather.bw_bytes_per_s
        row_wise_slowdown = seconds_per_byte * bw / 2  # against the all-to-all's 2 / bw
        row_wise_latency = max(
            0.0, m.reduce_scatter.latency_s + m.all_gather.latency_s - 2 * latency
        )
    return Topology(
        **{figure: getattr(m, figure) for figure in _AS_MEASURED},
        name=name,
        world_size=m.ranks,
        ranks_per_node=m.ranks,
        compute_device=m.device,
        device_memory_bytes=int(m.device_memory_bytes),
        host_memory_bytes=int(m.host_memory_bytes),
        device_memory_bw_bytes_per_s=2 * m.copy_bw_bytes_per_s,
        intra_node_bw_bytes_per_s=bw,
        inter_node_bw_bytes_per_s=inter_bw,
        network_latency_s=latency,
        row_wise_output_slowdown=row_wise_slowdown,
        row_wise_output_latency_s=row_wise_latency,
        sync_latency_s=None if m.sync_latency_s is None else max(latency, m.sync_latency_s),
        calibration="; ".join(
            (f"calibrated {m.device} x{m.ranks} on {m.machine or 'an unnamed machine'}", *m.notes)
        ),
    )


def summary(m: Measurements) -> str:
    """What `calibrate` measured, a line per kind of figure (printed to stderr)."""

    def si(v: float | None, unit: str) -> str:
        if v is None:
            return "-"
        exp = min(4, max(0, int(math.log10(max(v, 1.0)) // 3)))
        return f"{v / 10 ** (3 * exp):.3g} {' kMGT'[exp].strip()}{unit}"

    def link(name: str, fit: LinkFit | None) -> str:
        if fit is None:
            return f"  {name}: not measured (one rank)"
        return f"  {name}: latency {fit.latency_s * 1e6:.1f} us, {si(fit.bw_bytes_per_s, 'B/s')}"

    ms = "{:.3f} ms".format
    host_link = f"  host -> device     {si(m.host_to_device_bw_bytes_per_s, 'B/s')}"
    latency = f"latency {m.host_to_device_latency_s * 1e6:.1f} us"
    if m.device == "cpu":  # no link: the stager's rate, its bookkeeping in (not a copy's)
        host_link += (
            " of rows staged: distcache's stager with its bookkeeping (no device, no link), "
            + latency
        )
    else:
        host_link += (
            f", {latency}; device -> host {si(m.device_to_host_bw_bytes_per_s, 'B/s')}; "
            f"distcache's stager {si(m.staging_bytes_per_s, 'B/s')}"
        )

    def ns(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e9:.2f} ns"

    return "\n".join(
        [
            f"calibrated {m.device}, {m.ranks} ranks, {m.threads_per_rank} threads/rank, "
            f"{m.seconds:.1f} s, on {m.machine}",
            f"  memory copy        {si(m.copy_bw_bytes_per_s, 'B/s')}",
            host_link,
            f"  embedding lookup   {si(m.lookup_rows_per_s, 'rows/s')} + "
            f"{si(m.lookup_bytes_per_s, 'B/s')} (distcache's kernel), "
            f"{si(m.device_lookup_rows_per_s, 'rows/s')} + "
            f"{si(m.device_lookup_bytes_per_s, 'B/s')} (TorchRec's fused); its UVM cache "
            f"{ns(m.reactive_cache_s_per_id)} per id + {ns(m.reactive_cache_s_per_miss)} per miss",
            f"  dense compute      {si(m.dense_flops_per_s, 'FLOP/s')}, "
            f"{ms(1e3 * m.dense_layer_overhead_s)} per layer, activations "
            f"{si(m.dense_activation_bytes_per_s, 'B/s')}",
            f"  interaction        {ns(m.interaction_s_per_element)} per sample and element of "
            f"its vectors + {ns(m.interaction_s_per_pair)} per entry of their products",
            f"  dense update (DP)  {si(m.dense_update_bytes_per_s, 'B/s')}",
            f"  cache scheduler    {ms(1e3 * (m.schedule_s_per_batch or 0))} per batch + "
            f"{ns(m.schedule_s_per_id)} per id + {ns(m.schedule_s_per_candidate)} per "
            "candidate slot",
            f"  framework          {ms(1e3 * m.step_overhead_s)} per step, "
            f"{ms(1e3 * m.sharding_overhead_s)} per sharding type, "
            f"{1e9 * m.id_overhead_s:.0f} ns per id routed, "
            f"{1e9 * m.hot_bag_overhead_s:.0f} ns per bag of a table with hot rows",
            link("gloo all-to-all", m.all_to_all),
            link("gloo all-reduce", m.all_reduce),
            link("gloo reduce-scatter", m.reduce_scatter),
            link("gloo all-gather", m.all_gather),
            "  collective between compute bursts: "
            + ("-" if m.sync_latency_s is None else ms(1e3 * m.sync_latency_s)),
            f"  memory per rank    device {si(m.device_memory_bytes, 'B')}, "
            f"host {si(m.host_memory_bytes, 'B')}",
            *(f"  note: {note}" for note in m.notes),
        ]
    )
