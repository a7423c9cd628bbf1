"""Plans side by side: distcache's, TorchRec's, simple baselines and the user's, all priced by
distcache's cost model on one workload and topology.

Every figure here is *modelled*, not measured: the topologies of interest (8-64 GPUs) are not
the machine this runs on. Rows:

- ``distcache``: `solve` (its planning time is measured here);
- ``torchrec``: TorchRec's `EmbeddingShardingPlanner`, converted by `from_sharding_plan` and
  priced by distcache's model (its table-row-wise tables as TorchRec runs them: node-local
  reduce-scatter, then one all-to-all across nodes), next to TorchRec's own estimate of it;
- ``distcache without hot rows``: when distcache's plan replicates some tables' hot rows, the
  same placements without the replicas (what the hot rows buy; TorchRec's estimate cannot
  express replicas and prices both alike);
- ``all table-wise`` / ``all row-wise``: `uniform_plan` with every table on the device (noted
  when that does not fit);
- any plans the caller passes.

With `measure_rows` (`python -m distcache compare --measure`), every row's plan that fits is
also run for real on this machine when the topology fits it (`measure.measure_plans`; what
runs: `measured_runs`): TorchRec's plan runs on TorchRec's own kernels, sharders and pipeline,
as TorchRec runs it, the other plans through distcache's path (its sharder and
`LookaheadTrainPipeline`; device-stored tables on TorchRec's fused kernel, cached ones on
distcache's). On CPU (a CPU topology of at most `measure.MAX_LOCAL_RANKS` ranks) TorchRec keeps
every table on the device. With `device="cuda"` (a CUDA topology of one rank, on this
machine's GPU) TorchRec's plan runs as its planner made it (`ComparisonRow.torchrec_sharding`:
`fused` where rows fit the device memory, its UVM kernels where they do not). Other topologies
keep modelled figures only, and say why.

The per-term times are those of the rank that sets the step (the slowest), so they add up to
the step time. "TorchRec est" is TorchRec's own model of the same plan (`torchrec_estimate`;
its caches, look-ahead ones too, priced as TorchRec's UVM caches of the same size; blank where
TorchRec cannot express the plan, e.g. a cache on a CPU topology): it covers only the sparse
part (no dense MLPs, no input all-to-all), so compare it across rows, not with the step.
Below the table, `speedups` gives distcache's plan over TorchRec's by both models (and
measured, when measured): a gain one model alone shows is worth less.

Example::

    rows = compare(workload_preset("criteo-terabyte"), preset("h100", world_size=8))
    print(format_table(rows, title="criteo-terabyte on 8 H100"))
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from distcache.constants import HOT_ALL
from distcache.errors import DistcacheConfigError
from distcache.planner.cost import all_to_all_sent_bytes, plan_cost
from distcache.planner.solver import solve, uniform_plan
from distcache.planner.torchrec.export import from_sharding_plan
from distcache.planner.torchrec.planner import torchrec_estimate, torchrec_plan
from distcache.planner.types import (
    DEVICE,
    ROW_WISE,
    TABLE_WISE,
    Plan,
    PlanCost,
    SolverOptions,
    StepCost,
    Topology,
    Workload,
)
from distcache.tools.measure import (
    Measurement,
    MeasureOptions,
    measure_plans,
    unmeasurable_reason,
)

if TYPE_CHECKING:
    from torchrec.distributed.types import ShardingPlan

GB = 10**9  # as `topology.parse_bytes` reads "16GB"
MODELLED_NOTE = (
    "Memory, step terms and samples/s are modelled by distcache's cost model, not measured "
    "(the topology is not this machine). 'TorchRec est' is TorchRec's own model of the plan's "
    "embedding part (no dense MLPs, no input all-to-all); 'plan s' is measured planning time."
)
MEASURED_NOTE = (
    "Except 'measured ms' and 'measured samples/s': the median step of the plan run on this "
    "machine (local gloo ranks, or one GPU; TorchRec's plan on TorchRec's own kernels and "
    "pipeline, the others through distcache's sharder and pipeline), and 'a2a KB/rank': bytes "
    "a rank sent in one step's all-to-alls (ids; embeddings forward and backward), counted on "
    "that run, beside the model's figure."
)
NO_HOT_ROWS = "distcache without hot rows"
# (label, StepCost field) of the per-term columns, in step order.
TERMS = (
    ("dense", "dense_compute_s"),
    ("lookup", "lookup_s"),
    ("staging", "exposed_staging_s"),
    ("in a2a", "input_all_to_all_s"),
    ("out a2a", "output_all_to_all_s"),
    ("allreduce", "all_reduce_s"),
    ("overhead", "overhead_s"),
)


@dataclass(frozen=True, kw_only=True)
class ComparisonRow:
    """One plan, priced: memory, step terms, throughput. Figures are modelled."""

    name: str
    plan: Plan | None = None
    """None when the planner behind this row failed (see `note`)."""
    cost: PlanCost | None = None
    torchrec_estimate_s: float | None = None
    """TorchRec's own modelled time of this plan, where TorchRec can express it."""
    planning_s: float | None = None
    """Seconds the planner took (None for fixed plans)."""
    note: str = ""
    measured_step_s: float | None = None
    """Median step time of the plan run on this machine (`measure_rows`); None: not run."""
    measured_a2a_bytes: float | None = None
    """Bytes a rank sent in the all-to-alls of one measured step (ids; embeddings forward and
    backward), averaged over ranks; None: not run."""
    measured_on_distcache_s: float | None = None
    """TorchRec's row: its plan's measured step through distcache's path (the row's own
    measurement ran it on TorchRec's kernels and pipeline)."""
    modelled_a2a_bytes: float | None = None
    """The same as the cost model prices it (`cost.all_to_all_sent_bytes`), set beside the
    measured figure."""
    torchrec_sharding: ShardingPlan | None = None
    """TorchRec's row: the plan as its planner made it (kernels included), which `plan`
    approximates for distcache's cost model; what `measure_rows` runs on CUDA."""

    @property
    def critical_rank(self) -> int | None:
        if self.cost is None:
            return None
        totals = [c.total_s for c in self.cost.per_rank]
        return totals.index(max(totals))

    @property
    def terms_ms(self) -> dict[str, float]:
        """The slowest rank's step terms, ms (they sum to `step_ms`)."""
        if self.cost is None:
            return {}
        step: StepCost = self.cost.per_rank[self.critical_rank]
        return {label: 1e3 * getattr(step, field) for label, field in TERMS}

    @property
    def step_ms(self) -> float | None:
        return None if self.cost is None else 1e3 * self.cost.step_s

    @property
    def samples_per_s(self) -> float | None:
        return None if self.cost is None else self.cost.samples_per_s

    @property
    def device_memory_gb(self) -> float | None:
        return None if self.cost is None else max(self.cost.device_memory_bytes) / GB

    @property
    def host_memory_gb(self) -> float | None:
        return None if self.cost is None else max(self.cost.host_memory_bytes) / GB

    @property
    def fits(self) -> bool | None:
        return None if self.cost is None else self.cost.fits

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "modelled": True,
            "device_memory_gb_max": self.device_memory_gb,
            "host_memory_gb_max": self.host_memory_gb,
            "terms_ms": self.terms_ms,
            "critical_rank": self.critical_rank,
            "step_ms": self.step_ms,
            "samples_per_s": self.samples_per_s,
            "fits": self.fits,
            "violations": list(self.cost.violations) if self.cost else [],
            "torchrec_estimate_ms": (
                None if self.torchrec_estimate_s is None else 1e3 * self.torchrec_estimate_s
            ),
            "planning_s": self.planning_s,
            "measured_step_ms": (
                None if self.measured_step_s is None else 1e3 * self.measured_step_s
            ),
            "measured_on_distcache_engine_step_ms": (
                None if self.measured_on_distcache_s is None else 1e3 * self.measured_on_distcache_s
            ),
            "measured_all_to_all_kb_per_rank": (
                None if self.measured_a2a_bytes is None else self.measured_a2a_bytes / 1e3
            ),
            "modelled_all_to_all_kb_per_rank": (
                None if self.modelled_a2a_bytes is None else self.modelled_a2a_bytes / 1e3
            ),
            "note": self.note,
            "plan": None if self.plan is None else json.loads(self.plan.to_json()),
        }


def compare(
    workload: Workload,
    topology: Topology,
    *,
    plans: dict[str, Plan] | None = None,
    include_torchrec: bool = True,
    torchrec_timeout_s: float | None = None,
    options: SolverOptions | None = None,
) -> list[ComparisonRow]:
    """Price distcache's plan, TorchRec's, the uniform baselines and `plans` on one topology.

    Args:
        workload: the model and batch size.
        topology: the hardware (modelled: it need not be this machine).
        plans: extra plans by row name, e.g. loaded from JSON; each must place every table.
        include_torchrec: run TorchRec's planner (seconds to a minute on large topologies) and
            fill in TorchRec's own estimates.
        torchrec_timeout_s: passed to TorchRec's planner.
        options: distcache's solver options (default: `SolverOptions`'s, explaining no table:
            the rows show no reasons).

    Example::

        rows = compare(workload, topology, plans={"mine": Plan.load("mine.json")})
    """
    start = time.perf_counter()
    try:
        ours = solve(workload, topology, options=options or SolverOptions(explain=False))
        rows = [_row("distcache", ours, workload, topology, include_torchrec, start)]
        hot = [
            f"{t.table} {t.hot_rows}{' (touched rows all-gathered)' * (t.hot_reduce != HOT_ALL)}"
            for t in ours.tables
            if t.hot_rows
        ]
        if hot:  # the same placements without their replicas: what the hot rows buy
            rows[0] = _with_note(rows[0], _hot_note(hot, len(ours.tables)))
            stripped = replace(
                ours,
                name=f"{ours.name}-no-hot-rows",
                tables=tuple(replace(t, hot_rows=0) for t in ours.tables),
                explanations={},
            )
            rows.append(_row(NO_HOT_ROWS, stripped, workload, topology, include_torchrec))
    except DistcacheConfigError as err:  # no placement fits
        rows = [
            ComparisonRow(name="distcache", planning_s=time.perf_counter() - start, note=str(err))
        ]
    if include_torchrec:
        rows.append(_torchrec_row(workload, topology, torchrec_timeout_s))
    for label, sharding in (("all table-wise", TABLE_WISE), ("all row-wise", ROW_WISE)):
        try:
            plan = uniform_plan(workload, topology, sharding, name=label)
        except DistcacheConfigError as err:
            rows.append(ComparisonRow(name=label, note=str(err)))
            continue
        row = _row(label, plan, workload, topology, include_torchrec)
        if not row.fits:
            row = _with_note(row, "does not fit with every table on the device")
        rows.append(row)
    for name, plan in (plans or {}).items():
        rows.append(_row(name, plan, workload, topology, include_torchrec))
    return rows


def _row(
    name: str,
    plan: Plan,
    workload: Workload,
    topology: Topology,
    with_torchrec: bool,
    planning_start: float | None = None,
) -> ComparisonRow:
    planning_s = None if planning_start is None else time.perf_counter() - planning_start
    cost = plan_cost(plan, workload, topology)
    estimate = torchrec_estimate(plan, workload, topology) if with_torchrec else None
    note = "; ".join(cost.violations)
    return ComparisonRow(
        name=name,
        plan=plan,
        cost=cost,
        torchrec_estimate_s=estimate,
        planning_s=planning_s,
        note=note,
    )


def _torchrec_row(workload: Workload, topology: Topology, timeout_s: float | None) -> ComparisonRow:
    result = torchrec_plan(workload, topology, timeout_s=timeout_s)
    if result.plan is None:
        first_line = (result.error or "failed").strip().splitlines()[0]
        return ComparisonRow(
            name="torchrec", planning_s=result.planning_s, note=f"planner: {first_line}"
        )
    plan = from_sharding_plan(result.plan, workload, world_size=topology.world_size)
    cost = plan_cost(plan, workload, topology)
    return ComparisonRow(
        name="torchrec",
        plan=plan,
        cost=cost,
        torchrec_estimate_s=result.estimate_s,
        planning_s=result.planning_s,
        note="; ".join(cost.violations),
        torchrec_sharding=result.plan,
    )


def speedups(rows: list[ComparisonRow], ours: str = "distcache", theirs: str = "torchrec") -> dict:
    """Row `ours` over row `theirs` (step time ratios, > 1: ours is faster) by distcache's cost
    model, by TorchRec's estimator and measured; None where a row lacks the figure."""
    by_name = {r.name: r for r in rows}
    a, b = by_name.get(ours), by_name.get(theirs)

    def ratio(x: float | None, y: float | None) -> float | None:
        return None if x is None or y is None or x <= 0 else y / x

    out = dict.fromkeys(
        ("distcache_model", "torchrec_estimator", "measured", "measured_same_engine")
    )
    if a is not None and b is not None:
        out = {
            "distcache_model": ratio(a.cost and a.cost.step_s, b.cost and b.cost.step_s),
            "torchrec_estimator": ratio(a.torchrec_estimate_s, b.torchrec_estimate_s),
            "measured": ratio(a.measured_step_s, b.measured_step_s),
            "measured_same_engine": ratio(a.measured_step_s, b.measured_on_distcache_s),
        }
    plain = by_name.get(NO_HOT_ROWS)
    if a is not None and plain is not None:  # what the hot rows buy, same placements
        out["hot_rows_model"] = ratio(a.cost and a.cost.step_s, plain.cost and plain.cost.step_s)
        out["hot_rows_measured"] = ratio(a.measured_step_s, plain.measured_step_s)
    return out


@dataclass(frozen=True, kw_only=True)
class MeasuredRuns:
    """What `measure_rows` runs (`measured_runs`), as `measure.measure_plans` takes it."""

    plans: dict[str, Plan]
    """The plans of the rows that fit, by row name; and TorchRec's again as `engine_twin`."""
    torchrec_kernels: tuple[str, ...] = ()
    """Rows run on TorchRec's own kernels and pipeline: TorchRec's (on CPU only when it keeps
    every table on the device: TorchRec has no cache there)."""
    torchrec_plans: dict[str, ShardingPlan] = field(default_factory=dict)
    """On CUDA, TorchRec's own plan of each of those rows, run with the kernels it chose."""
    engine_twin: str | None = None
    """The name under which TorchRec's all-device plan also runs through distcache's path."""


def measured_runs(rows: list[ComparisonRow], *, device: str = "cpu") -> MeasuredRuns:
    """Which rows' plans `measure_rows` runs on `device`, and on whose kernels; nothing runs."""
    plans = {r.name: r.plan for r in rows if r.plan is not None and r.fits}
    by_name = {r.name: r for r in rows}
    on_device = {name: all(t.storage == DEVICE for t in p.tables) for name, p in plans.items()}
    theirs = tuple(
        name for name in plans if name == "torchrec" and (device == "cuda" or on_device[name])
    )
    torchrec_plans = {
        name: by_name[name].torchrec_sharding
        for name in theirs
        if device == "cuda" and by_name[name].torchrec_sharding is not None
    }
    # TorchRec's plan through distcache's path too: its gap to TorchRec's own run is the path's,
    # its gap to distcache's plan (through the same path) the plan's.
    twin = None
    if theirs and on_device[theirs[0]]:
        twin = f"{theirs[0]} through distcache's path"
        plans[twin] = plans[theirs[0]]
    return MeasuredRuns(
        plans=plans, torchrec_kernels=theirs, torchrec_plans=torchrec_plans, engine_twin=twin
    )


def measure_rows(
    rows: list[ComparisonRow],
    workload: Workload,
    topology: Topology,
    *,
    options: MeasureOptions | None = None,
    device: str = "cpu",
) -> tuple[list[ComparisonRow], str]:
    """`rows` with `measured_step_s` filled in by running their plans here, in turns.

    Rows without a plan, or whose plan does not fit the topology, are not run (noted).

    Args:
        rows: from `compare`.
        workload: the rows' workload.
        topology: the rows' topology; it must fit this machine (`measure.unmeasurable_reason`).
        options: steps and warm-up of each run.
        device: "cpu" (local gloo ranks) or "cuda" (this machine's GPU, one rank).

    Returns:
        (rows, why nothing was measured: "" when something was).
    """
    runs = measured_runs(rows, device=device)
    count = max(1, len(runs.plans))
    reason = unmeasurable_reason(workload, topology, device=device, plans=count)
    if reason:
        return rows, f"not measured: {reason}; every figure is modelled"
    if not runs.plans:
        return rows, "not measured: no row has a plan that fits the topology"
    results = measure_plans(
        runs.plans,
        workload,
        world_size=topology.world_size,
        options=options,
        torchrec_kernels=runs.torchrec_kernels,
        device=device,
        torchrec_plans=runs.torchrec_plans,
    )
    return [_measured_row(row, results, runs, workload, topology) for row in rows], ""


def _measured_row(
    row: ComparisonRow,
    results: dict[str, Measurement],
    runs: MeasuredRuns,
    workload: Workload,
    topology: Topology,
) -> ComparisonRow:
    if row.name not in results:
        if row.plan is None:
            return row
        return _with_note(row, "not measured: the plan does not fit the topology")
    measured = results[row.name]
    modelled = all_to_all_sent_bytes(row.plan, workload, topology)
    row = replace(
        row,
        measured_step_s=measured.step_s,
        measured_a2a_bytes=measured.all_to_all_sent_bytes,
        modelled_a2a_bytes=float(modelled.mean()),
    )
    if row.name not in runs.torchrec_kernels:
        return row
    note = "measured on TorchRec's own kernels"
    if row.name in runs.torchrec_plans:
        note += f" as its planner chose them ({_kernel_counts(runs.torchrec_plans[row.name])})"
    if runs.engine_twin:
        twin = results[runs.engine_twin].step_s
        row = replace(row, measured_on_distcache_s=twin)
        note += (
            f"; the same plan through distcache's path: {1e3 * twin:.3f} ms "
            f"({row.cost.global_batch_size / twin:,.0f} samples/s)"
        )
    return _with_note(row, note)


def _kernel_counts(sharding_plan: ShardingPlan) -> str:
    """'fused 15, fused_uvm_caching 3': tables per kernel of a TorchRec plan."""
    kernels = Counter(s.compute_kernel for m in sharding_plan.plan.values() for s in m.values())
    return ", ".join(f"{kernel} {count}" for kernel, count in sorted(kernels.items()))


HOT_LISTED = 12  # tables a row's hot-rows note names (the plan, in --json, has them all)


def _hot_note(hot: list[str], tables: int) -> str:
    """The note naming the tables with replicas ("t3 1200, ..."), the first `HOT_LISTED`
    of them where more have one."""
    if len(hot) <= HOT_LISTED:
        return f"hot rows replicated: {', '.join(hot)}"
    return (
        f"hot rows replicated in {len(hot):,} of {tables:,} tables: "
        f"{', '.join(hot[:HOT_LISTED])}, ... (the plan in --json lists every table's)"
    )


def _with_note(row: ComparisonRow, note: str) -> ComparisonRow:
    return replace(row, note="; ".join(filter(None, (note, row.note))))


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def format_table(rows: list[ComparisonRow], *, title: str | None = None) -> str:
    """A fixed-width text table of `rows`, headed by `title` and the "modelled" label."""
    measured = any(r.measured_step_s is not None for r in rows)
    header = ["plan", "dev GB", "host GB", *(label for label, _ in TERMS)]
    header += ["step ms", "samples/s", "fits", "TorchRec est ms", "plan s"]
    header += ["measured ms", "measured samples/s", "a2a KB/rank meas/model"] if measured else []
    body = []
    for row in rows:
        terms = row.terms_ms
        cells = [
            row.name,
            _fmt(row.device_memory_gb),
            _fmt(row.host_memory_gb),
            *(_fmt(terms.get(label), 3) for label, _ in TERMS),
            _fmt(row.step_ms, 3),
            _fmt(row.samples_per_s, 0),
            {None: "-", True: "yes", False: "NO"}[row.fits],
            _fmt(None if row.torchrec_estimate_s is None else 1e3 * row.torchrec_estimate_s, 3),
            _fmt(row.planning_s, 1),
        ]
        if measured:
            step = row.measured_step_s
            batch = row.cost.global_batch_size if row.cost else None
            sent = (
                "-"
                if row.measured_a2a_bytes is None
                else f"{row.measured_a2a_bytes / 1e3:,.1f} / {row.modelled_a2a_bytes / 1e3:,.1f}"
            )
            cells += [
                _fmt(None if step is None else 1e3 * step, 3),
                _fmt(None if step is None or batch is None else batch / step, 0),
                sent,
            ]
        body.append(cells)
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))])

    out = [title] if title else []
    out += [MODELLED_NOTE + (" " + MEASURED_NOTE if measured else "")]
    out += [line(header), line(["-" * w for w in widths])]
    out += [line(cells) for cells in body]
    gains = speedups(rows)
    if gains["distcache_model"] is not None or gains["torchrec_estimator"] is not None:
        labels = {
            "distcache_model": "by distcache's cost model",
            "torchrec_estimator": "by TorchRec's estimator (caches as its UVM caches)",
            "measured": "measured here (TorchRec's plan on its own kernels)",
            "measured_same_engine": "measured with both plans through distcache's path",
        }
        parts = [
            f"{_fmt(v)} x {labels[k]}" for k, v in gains.items() if v is not None and k in labels
        ]
        out += ["distcache's plan over TorchRec's: " + "; ".join(parts)]
    hot = {"hot_rows_model": "modelled", "hot_rows_measured": "measured here"}
    parts = [f"{_fmt(v)} x {hot[k]}" for k, v in gains.items() if v is not None and k in hot]
    if parts:
        out += ["distcache's plan over the same without hot rows: " + "; ".join(parts)]
    notes = [f"  {row.name}: {row.note}" for row in rows if row.note]
    if notes:
        out += ["notes:", *notes]
    return "\n".join(out)


def rows_to_json(
    rows: list[ComparisonRow],
    *,
    workload: Workload | None = None,
    topology: Topology | None = None,
) -> str:
    """The rows (with their plans) as JSON, labelled modelled, with the inputs when given."""
    measured = any(r.measured_step_s is not None for r in rows)
    data: dict[str, object] = {
        "modelled": True,
        "measured": measured,
        "note": MODELLED_NOTE + (" " + MEASURED_NOTE if measured else ""),
    }
    if workload is not None:
        data["workload"] = workload.name
        data["batch_size_per_rank"] = workload.batch_size_per_rank
    if topology is not None:
        data["topology"] = topology.to_dict()
    data["rows"] = [row.to_dict() for row in rows]
    data["distcache_over_torchrec"] = speedups(rows)
    return json.dumps(data, indent=2)
