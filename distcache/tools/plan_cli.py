"""`python -m distcache plan|compare`: plan a workload on a topology, or compare plans.

Both commands take a workload and a topology:

- ``--preset NAME``: a workload preset (`criteo-kaggle`, `criteo-terabyte`,
  `synthetic:tables=T,rows=R,dim=D,alpha=A,pooling=P,seed=S,spread=X`), or
  ``--config FILE``: a TOML description (below), or a training job's config (`configs/*.toml`:
  its tables, batch size, MLPs and embedding optimizer, as `python -m distcache train` plans it).
- ``--topology h100|h200|cpu|PATH.json`` (a JSON from `save_topology` or `python -m distcache
  calibrate`; default h100 with ``--world-size`` 8, and for a job's config the job's own: its
  `[plan] topology`, else its device's, on 2 ranks as `launch/torchrun.sh` starts it, which
  the first line printed names), ``--world-size N``, ``--ranks-per-node N``,
  ``--device-memory 16GB`` (per rank, for embeddings), ``--host-memory 200GB`` (per rank),
  ``--batch-size N`` (per rank). Sizes read as in `topology.parse_bytes` (GB = 10^9,
  GiB = 2^30).

``plan`` prints each table's placement with the solver's reasons and the modelled step, and
writes ``--out plan.json`` (`Plan.save`; `Plan.load` reads it) and ``--torchrec-out FILE``:
the plan as a TorchRec `ShardingPlan` for `DistributedModelParallel` with
`CachedEmbeddingBagCollectionSharder` (and `CachedEmbeddingCollectionSharder` for sequence
tables), written with `torch.save` (it holds distcache and TorchRec classes, so load it with
``torch.load(FILE, weights_only=False)``; the EBC's path in the model is ``--module-path``,
default "" for a bare EBC, the `EmbeddingCollection`'s ``--sequence-module-path``).

``compare`` prints distcache's plan, TorchRec's, the all-table-wise and all-row-wise
baselines and every ``--plan FILE`` (repeatable) side by side (`compare.format_table`), or
JSON with ``--json`` (``--json-out FILE`` writes it beside the table); ``--no-torchrec`` skips
TorchRec's planner. Figures are modelled; with ``--measure`` each plan also runs here for
``--measure-steps`` steps after ``--measure-warmup`` (`compare.measure_rows`) when the topology
fits this machine (``cpu`` or a calibrated JSON, at most 2 ranks), next to its modelled step;
for larger topologies it says why nothing ran and the figures stay modelled. Measured against
a topology `calibrate` did not make (a preset), it says how far the modelled steps are from
the measured ones, and which `calibrate` command prices this machine.
``--measure --device cuda`` runs them on this machine's GPU instead, for a CUDA topology of one
rank (``--topology h100 --world-size 1``): TorchRec's plan on the kernels its planner chose for
``--device-memory`` (`fused`, its UVM cache `fused_uvm_caching`, `fused_uvm`), distcache's
through its sharder and look-ahead pipeline; on a machine without a GPU it exits with status 2
naming what is missing.

Config file (strict: an unknown section or key is an error naming the allowed ones)::

    [model]                         # optional, every key optional
    name = "my-dlrm"                # default: the file's stem
    batch_size_per_rank = 2048      # --batch-size overrides it
    dense_in_features = 13
    bottom_mlp = [512, 256, 128]
    top_mlp = [1024, 1024, 512, 256, 1]
    optimizer = "rowwise_adagrad"   # sgd | rowwise_adagrad | adagrad | adam
    dtype_bytes = 4

    [[tables]]                      # one per table, at least one
    name = "t0"                     # required
    rows = 1000000                  # required
    dim = 128                       # required
    pooling_factor = 1.0            # ids per sample (default 1.0)
    row_dtype_bytes = 2             # optional: fp16 rows (default: the model's dtype_bytes)
    pooled = false                  # optional: an EmbeddingCollection's table, one output per id
                                    # (default true: an EmbeddingBagCollection's, pooled per bag)
    alpha = 1.05                    # power-law exponent of the id distribution (default 1.05)

Bad flags and values exit with status 2 and a message naming the flag; a workload that no plan
fits exits with status 1.

Example::

    python -m distcache plan --preset criteo-terabyte --topology h100 --world-size 8 \\
        --device-memory 16GB --out plan.json
    python -m distcache compare --preset criteo-terabyte --world-size 64 --plan plan.json
    python -m distcache compare --config small.toml --topology topology.json --world-size 2 \\
        --measure
    python -m distcache compare --config configs/criteo_terabyte_synthetic.toml \\
        --topology h100 --world-size 1 --device-memory 16GB --measure --device cuda
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from distcache.arguments import positive_int
from distcache.errors import DistcacheConfigError
from distcache.planner.cost import plan_cost, validate_plan
from distcache.planner.solver import EXPLAINED, default_explained, explained_tables, solve
from distcache.planner.topology import PRESETS, load_topology, parse_bytes, preset
from distcache.planner.types import Plan, SolverOptions, TableStats, Topology, Workload
from distcache.planner.workloads import workload_preset
from distcache.tools.plan_text import format_plan, why_header, wrap

# `compare` and `export` import TorchRec (seconds): they are imported where they are used.

_T = TypeVar("_T")
_MODEL_KEYS = (
    "name",
    "batch_size_per_rank",
    "dense_in_features",
    "bottom_mlp",
    "top_mlp",
    "optimizer",
    "dtype_bytes",
)
_TABLE_KEYS = ("name", "rows", "dim", "pooling_factor", "alpha", "row_dtype_bytes", "pooled")
_TABLE_REQUIRED = ("name", "rows", "dim")


class _UsageError(Exception):
    """A bad flag or value: printed with the flag's name, exit status 2."""


# --------------------------------------------------------------------------------------------
# Arguments


def _table_names(text: str) -> bool | tuple[str, ...]:
    """--explain: 'all' (True), 'none' (False) or names separated by commas."""
    if text.strip() in ("all", "none"):
        return text.strip() == "all"
    names = tuple(name.strip() for name in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(
            f"expected 'all', 'none' or table names separated by commas, got {text!r}"
        )
    return names


def _byte_size(text: str) -> int:
    try:
        value = parse_bytes(text)
    except DistcacheConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size > 0, got {text!r}")
    return value


def output_file(text: str) -> Path:
    """An argparse type for a file a command writes when it ends: refused at once (before a
    solve or a measurement that the write would then lose) when its folder is missing or not
    writable, or when it names a folder."""
    path = Path(text)
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file's path")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(
            f"the folder {str(folder)!r} of {text!r} does not exist; create it or give a "
            "path in an existing folder"
        )
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"the folder {str(folder)!r} is not writable")
    return path


def _common_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help="workload preset, e.g. criteo-terabyte, synthetic:...")
    source.add_argument("--config", type=Path, help="TOML workload description")
    parser.add_argument(
        "--topology",
        help="h100, h200, cpu or a JSON file (default h100; for a job's config, the job's)",
    )
    parser.add_argument("--world-size", type=positive_int, help="ranks (default 8)")
    parser.add_argument("--ranks-per-node", type=positive_int)
    parser.add_argument("--device-memory", type=_byte_size, help="per rank, e.g. 16GB")
    parser.add_argument("--host-memory", type=_byte_size, help="per rank, e.g. 200GB")
    parser.add_argument("--batch-size", type=positive_int, help="samples per rank per step")
    return parser


def _run(
    main: Callable[[argparse.Namespace], int],
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
) -> int:
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exit_:  # argparse printed the usage and the error
        return int(exit_.code or 0)
    try:
        return main(args)
    except _UsageError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2


def _flag(flag: str, build: Callable[[], _T]) -> _T:
    """`build()`, its configuration errors reported against `flag`."""
    try:
        return build()
    except (DistcacheConfigError, OSError) as err:
        raise _UsageError(f"{flag}: {err}") from err


# --------------------------------------------------------------------------------------------
# Workload and topology


def workload_from_args(args: argparse.Namespace) -> Workload:
    if args.preset is not None:
        return _flag(
            f"--preset {args.preset}",
            lambda: workload_preset(args.preset, batch_size_per_rank=args.batch_size),
        )
    workload = _flag(f"--config {args.config}", lambda: load_workload_config(args.config))
    if args.batch_size is not None:
        workload = dataclasses.replace(workload, batch_size_per_rank=args.batch_size)
    return workload


def load_workload_config(path: Path) -> Workload:
    """A `Workload` from a TOML file (format in the module docstring)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as err:
        raise DistcacheConfigError(f"not valid TOML: {err}") from None
    if _is_job_data(data):  # a training job's config
        return _job_workload(path)
    _only(data, ("model", "tables"), "top-level sections")
    model = data.get("model", {})
    if not isinstance(model, dict):
        raise DistcacheConfigError("[model] must be a table")
    _only(model, _MODEL_KEYS, "[model] keys")
    tables = data.get("tables")
    if not isinstance(tables, list) or not tables:
        raise DistcacheConfigError("give at least one [[tables]] entry")
    stats = []
    for i, table in enumerate(tables):
        where = f"[[tables]] #{i + 1}"
        if not isinstance(table, dict):
            raise DistcacheConfigError(f"{where} must be a table")
        _only(table, _TABLE_KEYS, f"{where} keys")
        missing = [k for k in _TABLE_REQUIRED if k not in table]
        if missing:
            raise DistcacheConfigError(f"{where} lacks required keys {missing}")
        stats.append(TableStats(**table))
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in model.items()}
    fields.setdefault("name", Path(path).stem)
    try:
        return Workload(tables=tuple(stats), **fields)
    except TypeError as err:  # a wrongly typed value that the dataclass cannot take
        raise DistcacheConfigError(str(err)) from None


_JOB_SECTIONS = {"data", "train", "cache", "checkpoint", "plan", "run"}
_JOB_RANKS = 2  # launch/torchrun.sh's default NPROC


def _job_topology(path: Path | None) -> str | None:
    """For a training job's config, the topology the job plans on: its `[plan] topology`, else
    its device's (`cpu`, or `h100` for CUDA); None for anything else."""
    if path is None or not _is_job_config(path):
        return None
    config = _job_config(path)
    return config.plan.topology or ("cpu" if config.train.device == "cpu" else "h100")


def _job_config(path: Path):  # noqa: ANN202 (the job's JobConfig, imported late)
    """A training job's config, read once per command (the topology and the workload both
    need it; a file changed since is read again)."""
    stat = Path(path).stat()
    return _job_config_of(Path(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _job_config_of(path: Path, mtime_ns: int, size: int):  # noqa: ANN202
    del mtime_ns, size  # (the cache's key)
    from distcache.job.config import load_job_config

    return load_job_config(path)


def _is_job_config(path: Path) -> bool:
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return False  # reported where the workload is read
    return _is_job_data(data)


def _is_job_data(data: Mapping[str, object]) -> bool:
    """Whether a parsed TOML file is a training job's config, not a workload description."""
    return "tables" not in data and bool(set(data) & _JOB_SECTIONS)


def _job_workload(path: Path) -> Workload:
    """The workload a training job's config describes, as the job itself plans it."""
    from distcache.data.sources import JobData
    from distcache.job.placement import job_workload

    config = _job_config(path)
    data = JobData(config.data, steps=config.train.steps, rank=0, world_size=1)
    return dataclasses.replace(job_workload(config, data), name=Path(path).stem)


def _only(data: Mapping[str, object], allowed: Sequence[str], what: str) -> None:
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise DistcacheConfigError(f"unknown {what} {unknown}; allowed: {list(allowed)}")


def topology_from_args(args: argparse.Namespace) -> Topology:
    if args.topology is None:  # a job's config plans for the job's own topology
        job = _job_topology(args.config)
        args.topology = job or "h100"
        args.world_size = args.world_size or (_JOB_RANKS if job else None)
    flag = f"--topology {args.topology}"
    if args.topology in PRESETS:
        topology = _flag(
            flag,
            lambda: preset(
                args.topology,
                world_size=args.world_size or 8,
                device_memory_bytes=args.device_memory,
                ranks_per_node=args.ranks_per_node,
            ),
        )
    elif args.topology.endswith(".json"):
        topology = _flag(flag, lambda: load_topology(args.topology))
        overrides = {
            "world_size": args.world_size,
            "device_memory_bytes": args.device_memory,
            "ranks_per_node": args.ranks_per_node,
        }
        topology = _replace(topology, overrides, "--world-size/--device-memory/--ranks-per-node")
    else:
        raise _UsageError(f"{flag}: expected one of {list(PRESETS)} or a .json file")
    return _replace(topology, {"host_memory_bytes": args.host_memory}, "--host-memory")


def _replace(topology: Topology, overrides: dict[str, int | None], flags: str) -> Topology:
    given = {k: v for k, v in overrides.items() if v is not None}
    if not given:
        return topology
    if "world_size" in given or "ranks_per_node" in given:
        world = given.get("world_size", topology.world_size)
        given["ranks_per_node"] = min(given.get("ranks_per_node", topology.ranks_per_node), world)
    return _flag(flags, lambda: dataclasses.replace(topology, **given))


# --------------------------------------------------------------------------------------------
# plan


def _plan(args: argparse.Namespace) -> int:
    # The solver makes millions of short-lived objects and few cycles: collecting as it goes
    # costs a tenth of a 1,000-table plan. Collected once, when the plan is printed.
    gc.disable()
    try:
        return _plan_printed(args)
    finally:
        gc.enable()


def _plan_printed(args: argparse.Namespace) -> int:
    workload, topology = workload_from_args(args), topology_from_args(args)
    try:
        explain = default_explained(workload) if args.explain is None else args.explain
        _flag("--explain", lambda: explained_tables(workload, explain))
        plan = solve(workload, topology, options=SolverOptions(explain=explain))
    except DistcacheConfigError as err:
        print(f"no plan: {err}", file=sys.stderr)
        return 1
    cost = plan_cost(plan, workload, topology)
    print(f"{workload.name} on {_topology_text(topology)}")
    print(format_plan(plan, workload, why=why_header(workload, plan)))
    print(
        f"\nmodelled step {1e3 * cost.step_s:.3f} ms, {cost.samples_per_s:,.0f} samples/s; "
        f"max per rank: device {max(cost.device_memory_bytes) / 1e9:.2f} GB, "
        f"host {max(cost.host_memory_bytes) / 1e9:.2f} GB; fits: {'yes' if cost.fits else 'NO'}"
    )
    for violation in cost.violations:
        print(wrap(violation, "  ", "    "))
    if args.out is not None:
        _flag(f"--out {args.out}", lambda: plan.save(args.out))
        print(f"wrote {args.out}")
    if args.torchrec_out is not None:
        _save_torchrec(plan, workload, topology, args)
        print(f"wrote {args.torchrec_out} (torch.load(..., weights_only=False))")
    return 0


def _save_torchrec(
    plan: Plan, workload: Workload, topology: Topology, args: argparse.Namespace
) -> None:
    import torch

    from distcache.planner.torchrec.export import to_sharding_plan

    sharding_plan = _flag(
        "--torchrec-out",
        lambda: to_sharding_plan(
            plan,
            workload,
            module_path=args.module_path,
            sequence_module_path=args.sequence_module_path,
            world_size=topology.world_size,
            ranks_per_node=topology.ranks_per_node,
            device=topology.compute_device,
        ),
    )
    _flag(
        f"--torchrec-out {args.torchrec_out}", lambda: torch.save(sharding_plan, args.torchrec_out)
    )


def _topology_text(topology: Topology) -> str:
    return (
        f"{topology.name} ({topology.world_size} ranks, {topology.ranks_per_node} per node, "
        f"{topology.compute_device}, {topology.device_memory_bytes / 1e9:.1f} GB device memory "
        f"per rank)"
    )


def plan_main(argv: Sequence[str] | None = None) -> int:
    """`python -m distcache plan`: solve, print the placement, write JSON / TorchRec plans."""
    parser = _common_parser("python -m distcache plan", "Plan a workload on a topology.")
    parser.add_argument("--out", type=output_file, help="write the plan as JSON")
    parser.add_argument("--torchrec-out", type=output_file, help="write a TorchRec ShardingPlan")
    parser.add_argument(
        "--explain",
        type=_table_names,
        metavar="TABLES",
        help="whose placement the solver explains under 'why:' (and in --out): 'all', 'none' or "
        f"table names separated by commas (default: every table of at most {EXPLAINED}, else "
        f"the {EXPLAINED} largest)",
    )
    parser.add_argument("--module-path", default="", help="the EBC's path in the model")
    parser.add_argument(
        "--sequence-module-path",
        help="the EmbeddingCollection's path in the model (sequence tables: pooled = false)",
    )
    return _run(_plan, parser, sys.argv[1:] if argv is None else argv)


# --------------------------------------------------------------------------------------------
# compare


def _load_plans(paths: Sequence[Path], workload: Workload, topology: Topology) -> dict[str, Plan]:
    plans: dict[str, Plan] = {}
    for path in paths:
        plan = _flag(f"--plan {path}", lambda path=path: _read_plan(path))
        _flag(f"--plan {path}", lambda plan=plan: validate_plan(plan, workload, topology))
        name = plan.name if plan.name not in plans else f"{plan.name} ({path})"
        plans[name] = plan
    return plans


def _read_plan(path: Path) -> Plan:
    try:
        return Plan.load(path)
    except (ValueError, TypeError, KeyError) as err:  # JSON or field errors
        if isinstance(err, DistcacheConfigError):
            raise
        raise DistcacheConfigError(f"not a plan JSON: {err}") from None


def _compare(args: argparse.Namespace) -> int:
    from distcache.tools.compare import compare, format_table, measure_rows, rows_to_json

    workload, topology = workload_from_args(args), topology_from_args(args)
    if args.device == "cuda":
        _check_cuda(args.measure)
    plans = _load_plans(args.plan, workload, topology)
    rows = compare(
        workload,
        topology,
        plans=plans,
        include_torchrec=not args.no_torchrec,
        torchrec_timeout_s=args.torchrec_timeout,
    )
    if args.measure:
        from distcache.tools.measure import MeasureOptions

        # One rank owns a GPU machine's cores; on CPU, ranks share them (one thread each).
        threads = (os.cpu_count() or 1) if args.device == "cuda" else 1
        options = MeasureOptions(
            steps=args.measure_steps, warmup=args.measure_warmup, threads=threads
        )
        rows, skipped = measure_rows(rows, workload, topology, options=options, device=args.device)
        if skipped:
            print(f"--measure: {skipped}", file=sys.stderr)
        _uncalibrated_hint(rows, topology, args)
    # Printed first: a write that fails still leaves the rows (measured ones took minutes).
    if args.json:
        print(rows_to_json(rows, workload=workload, topology=topology))
    else:
        print(format_table(rows, title=f"{workload.name} on {_topology_text(topology)}"))
    if args.json_out is not None:
        text = rows_to_json(rows, workload=workload, topology=topology)
        _flag(f"--json-out {args.json_out}", lambda: args.json_out.write_text(text + "\n"))
    return 0


def _uncalibrated_hint(rows: Sequence, topology: Topology, args: argparse.Namespace) -> None:
    """Where plans ran against a topology `calibrate` did not measure (a preset, or one written
    by hand), how far its modelled steps are from the measured ones, and how to price this
    machine instead."""
    ratios = [r.measured_step_s / r.cost.step_s for r in rows if r.measured_step_s and r.cost]
    if topology.calibration is not None or not ratios:
        return
    ranks = "--device cuda --ranks 1" if args.device == "cuda" else f"--ranks {topology.world_size}"
    print(
        f"--measure: the topology {topology.name} is not a calibration of this machine: the "
        f"measured steps are {min(ratios):.2g}-{max(ratios):.2g} x the modelled ones; "
        f"`python -m distcache calibrate {ranks} --out topology.json`, then --topology "
        "topology.json, prices this machine",
        file=sys.stderr,
    )


def _check_cuda(measure: bool) -> None:
    """`--device cuda`: only `--measure` runs plans, and it needs what `cuda_missing` names."""
    if not measure:
        raise _UsageError("--device cuda: only --measure runs plans; add --measure")
    from distcache.tools.machine import cuda_missing

    missing = cuda_missing()
    if missing:
        raise _UsageError(f"--device cuda: {missing}; allowed here: --device cpu")


def compare_main(argv: Sequence[str] | None = None) -> int:
    """`python -m distcache compare`: distcache's plan against TorchRec's and baselines."""
    parser = _common_parser(
        "python -m distcache compare", "Compare plans on one workload and topology (modelled)."
    )
    parser.add_argument(
        "--plan", type=Path, action="append", default=[], help="a plan JSON (repeatable)"
    )
    parser.add_argument("--no-torchrec", action="store_true", help="skip TorchRec's planner")
    parser.add_argument(
        "--torchrec-timeout", type=positive_int, help="seconds for TorchRec's proposals"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--json-out", type=output_file, help="also write the JSON to this file")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="also run each plan here (CPU topologies of <= 2 ranks; with --device cuda, "
        "a CUDA topology of 1) and report its step time",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where --measure runs the plans: local gloo ranks (cpu), or this machine's GPU "
        "(cuda: a CUDA topology of one rank)",
    )
    parser.add_argument(
        "--measure-steps", type=positive_int, default=20, help="timed steps per plan"
    )
    parser.add_argument(
        "--measure-warmup", type=positive_int, default=10, help="warm-up steps per plan"
    )
    return _run(_compare, parser, sys.argv[1:] if argv is None else argv)
