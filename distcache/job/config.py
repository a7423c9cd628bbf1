"""The training job's configuration: strict TOML, one small dataclass per section.

A job config is a TOML file (`configs/*.toml`) with the sections below; every key has a
default, so a file names only what it changes. Loading is strict: an unknown section or key,
a value of the wrong type or out of range is an error naming it and what is allowed, raised
before any process group starts. Command-line overrides `--section.key=value` take TOML
values (`--cache.capacity=0.02`, `--model.bottom_mlp=[64,16]`, `--data.source=synthetic`;
a bare word is a string). The resolved config is written to the run directory
(`resolved_config.toml`), so a run can be repeated exactly.

`parse_args` reads the command line of `python -m distcache train` (`distcache.job.check`
checks what a job can know before any process starts: files, packages, devices).

Example::

    config = load_job_config("configs/tiny_cpu.toml", ["--train.steps=50"])
    print(config.cache.capacity, config.run.dir)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from distcache.cache.config import CacheConfig
from distcache.data.synthetic import synthetic_preset
from distcache.errors import DistcacheConfigError
from distcache.planner.topology import PRESETS, load_topology, preset
from distcache.planner.types import Topology

DATA_SOURCES = ("synthetic", "criteo_tsv", "criteo_npy")
PLANNERS = ("distcache", "torchrec", "table_wise", "row_wise")
TOPOLOGY_PLANNERS = ("distcache", "torchrec")
_T = TypeVar("_T")
# How a component's own config names a bad value (`CacheConfig`): re-worded for the job's file.
_COMPONENT_ERROR = re.compile(
    r"(?P<cls>\w+)\.(?P<key>\w+)=(?P<value>.*?) is invalid: expected (?P<allowed>.*)", re.S
)


def _fail(message: str) -> typing.NoReturn:
    raise DistcacheConfigError(message)


def _require(ok: bool, section: str, key: str, value: object, allowed: str) -> None:
    if not ok:
        _fail(f"[{section}] {key} = {value!r} is invalid: expected {allowed}")


ON_BAD_BATCH = ("raise", "skip")
EMBEDDING_DTYPES = ("fp32", "fp16", "bf16")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: str = "synthetic"
    """'synthetic' (power-law click log), 'criteo_tsv' (raw Criteo) or 'criteo_npy'
    (TorchRec's preprocessed layout)."""
    preset: str = "tiny"
    """Synthetic: a `distcache.data.synthetic_preset` spec, e.g. 'criteo-kaggle:scale=1000'."""
    table_sizes: list[int] = field(default_factory=list)
    """Rows per table; ids are hashed to them (Criteo). Empty: the preset's sizes."""
    paths: list[str] = field(default_factory=list)
    """Criteo TSV files, or one directory plus `day` for the npy layout."""
    day: int = 0
    batch_size: int = 256
    """Samples per rank per batch."""
    seed: int = 0
    eval_batches: int = 8
    """Held-out batches per rank for evaluation (synthetic: drawn apart from the training
    ones; Criteo: the first of `eval_paths`)."""
    eval_paths: list[str] = field(default_factory=list)
    """Criteo files to evaluate on (none: no held-out evaluation)."""
    weighted: bool = False
    """Weighted features: a weight per id (synthetic data only; the model's tables become a
    weighted `EmbeddingBagCollection`)."""
    on_bad_batch: str = "raise"
    """A training batch that fails the checks of `distcache.job.batches`: 'raise' (stop the
    job with an error naming it) or 'skip' (skip it on every rank and count it)."""

    def __post_init__(self) -> None:
        _require(
            self.source in DATA_SOURCES, "data", "source", self.source, f"one of {DATA_SOURCES}"
        )
        _require(self.batch_size >= 1, "data", "batch_size", self.batch_size, "an integer >= 1")
        _require(self.eval_batches >= 0, "data", "eval_batches", self.eval_batches, ">= 0")
        _require(
            self.on_bad_batch in ON_BAD_BATCH,
            "data",
            "on_bad_batch",
            self.on_bad_batch,
            f"one of {ON_BAD_BATCH}",
        )
        _require(
            all(isinstance(r, int) and r >= 1 for r in self.table_sizes),
            "data",
            "table_sizes",
            self.table_sizes,
            "a list of integers >= 1",
        )
        _require(
            self.source == "synthetic" or not self.weighted,
            "data",
            "weighted",
            self.weighted,
            "false for Criteo data, which has no per-id weights",
        )
        _require(
            self.source == "synthetic" or bool(self.paths),
            "data",
            "paths",
            self.paths,
            f"at least one path for source {self.source!r}",
        )
        if self.source == "synthetic":
            try:
                synthetic_preset(self.preset)
            except DistcacheConfigError as err:
                _fail(f"[data] preset = {self.preset!r} is invalid: {err}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    embedding_dim: int = 16
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 16])
    """Ends with embedding_dim (DLRM's interaction needs equal widths)."""
    top_mlp: list[int] = field(default_factory=lambda: [64, 1])
    """Ends with 1 (the click logit)."""
    embedding_dtype: str = "fp32"
    """The tables' `data_type`: 'fp32', 'fp16' or 'bf16' (half rows: half the host memory and
    the bytes staged; pooled and updated in fp32, the optimizer state fp32)."""

    def __post_init__(self) -> None:
        d = self.embedding_dim
        _require(d >= 1, "model", "embedding_dim", d, "an integer >= 1")
        _require(
            self.embedding_dtype in EMBEDDING_DTYPES,
            "model",
            "embedding_dtype",
            self.embedding_dtype,
            f"one of {EMBEDDING_DTYPES}",
        )
        _require(
            bool(self.bottom_mlp) and self.bottom_mlp[-1] == d,
            "model",
            "bottom_mlp",
            self.bottom_mlp,
            f"a non-empty list of layer widths ending with embedding_dim = {d}",
        )
        _require(
            bool(self.top_mlp) and self.top_mlp[-1] == 1,
            "model",
            "top_mlp",
            self.top_mlp,
            "a non-empty list of layer widths ending with 1",
        )


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    planner: str = "table_wise"
    """'distcache' (the throughput planner), 'torchrec' (TorchRec's planner), 'table_wise' or
    'row_wise' (every table so), or a path to a plan JSON written by `python -m distcache
    plan`."""
    topology: str = ""
    """What the 'distcache' and 'torchrec' planners plan for: a preset ('cpu', 'h100', 'h200')
    or a topology JSON (`python -m distcache calibrate`), resized to the job's ranks. Unset:
    the 'cpu' preset for 'distcache', TorchRec's default topology for 'torchrec'. The other
    planners place tables without one, and refuse it."""
    sample_batches: int = 64
    """Criteo data: rank 0's first training batches whose ids are counted to give the
    'distcache' planner each table's access profile and hottest rows (which a plan may
    replicate, `hot_rows`; a plan file's too). 0: no sample: a power law of exponent 1.05 and
    no hot rows. Synthetic data knows its tables' popularity and needs none."""

    def __post_init__(self) -> None:
        _require(
            self.planner in PLANNERS or self.planner.endswith(".json"),
            "plan",
            "planner",
            self.planner,
            f"one of {PLANNERS} or a plan .json file",
        )
        _require(
            not self.topology or self.planner in TOPOLOGY_PLANNERS,
            "plan",
            "topology",
            self.topology,
            f"no topology with planner = {self.planner!r} (only {TOPOLOGY_PLANNERS} plan for one)",
        )
        _require(
            type(self.sample_batches) is int and self.sample_batches >= 0,
            "plan",
            "sample_batches",
            self.sample_batches,
            "an integer >= 0",
        )


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 100
    """Training batches per rank."""
    dense_learning_rate: float = 0.05
    log_every: int = 10
    eval_every: int = 0
    """Evaluate every this many steps (0: at the end only)."""
    progress_bar: bool = True
    """Rank 0 shows a progress bar, when its stderr is a terminal."""
    tensorboard: bool = False
    device: str = "cpu"
    """'cpu' or 'cuda' (one GPU per rank, LOCAL_RANK)."""
    on_nonfinite: str = "stop"
    """A non-finite loss: 'stop' (the job stops at the next checkpoint, which is not written)
    or 'skip' (the step's backward is skipped on every rank and counted; costs one all-reduce
    and one device read per step; 20 skipped in a row stop the job)."""

    def __post_init__(self) -> None:
        _require(self.steps >= 1, "train", "steps", self.steps, "an integer >= 1")
        _require(
            math.isfinite(self.dense_learning_rate) and self.dense_learning_rate > 0,
            "train",
            "dense_learning_rate",
            self.dense_learning_rate,
            "a finite number > 0",
        )
        _require(self.log_every >= 0, "train", "log_every", self.log_every, ">= 0")
        _require(self.eval_every >= 0, "train", "eval_every", self.eval_every, ">= 0")
        _require(self.device in ("cpu", "cuda"), "train", "device", self.device, "'cpu' or 'cuda'")
        _require(
            self.on_nonfinite in ("stop", "skip"),
            "train",
            "on_nonfinite",
            self.on_nonfinite,
            "'stop' or 'skip'",
        )


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every: int = 0
    """Save a checkpoint every this many steps (0: never)."""
    dir: str = ""
    """Default: `<run dir>/checkpoints`."""
    resume: bool = False
    """Continue from the latest checkpoint, if any (none: start at step 0, saying so)."""
    require: bool = False
    """With `resume`: a missing checkpoint is an error, not a fresh start (`--resume=require`)."""
    start_over: bool = False
    """Without `resume`: start from step 0 even where the checkpoint directory holds
    checkpoints, which are moved into `superseded.N/` there (`--resume=never`). Otherwise such
    a run refuses: it would overwrite them."""
    keep_last: int = 0
    """Keep the newest this many checkpoints and delete older ones (0: keep every one)."""

    def __post_init__(self) -> None:
        _require(self.every >= 0, "checkpoint", "every", self.every, "an integer >= 0")
        _require(self.keep_last >= 0, "checkpoint", "keep_last", self.keep_last, "an integer >= 0")
        _require(
            not (self.resume and self.start_over),
            "checkpoint",
            "start_over",
            self.start_over,
            "false with resume = true (continue, or start over: not both)",
        )


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    dir: str = "runs/default"
    """Where the resolved config, logs, metrics and checkpoints go."""


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A training job: one section per component.

    `[cache]` is the caches' own `CacheConfig` (every table's cache; `[plan] planner =
    "distcache"` sizes each table's capacity, L and K itself): its keys, defaults and checks
    are `distcache.cache.config`'s, with the same meaning as in Python: `capacity = 0.02` is a
    fraction of each table's rows, `capacity = 5000` a number of rows (`capacity = 1.0`: every
    row).
    """

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.run.dir) / "checkpoints")


_SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(JobConfig)}


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {name: hints[name] for name in _SECTIONS}


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


# Per scalar type: what a value must be, and what the message says is allowed.
_SCALARS: dict[object, tuple[typing.Callable[[object], bool], str]] = {
    float: (_is_number, "a number"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    bool: (lambda v: isinstance(v, bool), "true or false"),
    str: (lambda v: isinstance(v, str), "a string"),
}


def _coerce(section: str, key: str, value: object, hint: object) -> object:
    """Check `value` against the field's type; ints are accepted where floats are expected,
    and kept as written where either is (`float | int`: CacheConfig.capacity, a fraction or a
    number of rows, as in Python)."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union) and float in typing.get_args(hint):
        allowed = "a number (a float: a fraction of the rows; an int: a number of rows)"
        _require(_is_number(value), section, key, value, allowed)
        return value
    if origin is tuple:  # `tuple[int, ...]` (CacheConfig.hot_rows): a list in the file
        _require(isinstance(value, list), section, key, value, f"a list ({hint})")
        item = (typing.get_args(hint) or (object,))[0]
        return tuple(_coerce(section, key, v, item) for v in value)
    if origin in (list, types.GenericAlias) or hint is list:
        _require(isinstance(value, list), section, key, value, f"a list ({hint})")
        (item,) = typing.get_args(hint) or (object,)
        return [_coerce(section, key, v, item) for v in value]
    if hint in _SCALARS:
        check, allowed = _SCALARS[hint]
        _require(check(value), section, key, value, allowed)
        return float(value) if hint is float else value
    return value


def build_job_config(raw: Mapping[str, object]) -> JobConfig:
    """A `JobConfig` from parsed TOML, strictly: unknown sections and keys are errors, all
    of a file's mistakes named in one `DistcacheConfigError`."""
    sections, problems, built = _section_types(), [], {}
    if unknown := sorted(set(raw) - set(sections)):
        problems.append(
            f"unknown config section(s) {unknown}; allowed sections: {sorted(sections)}"
        )
    for name, cls in sections.items():
        built[name], found = _build_section(name, cls, raw.get(name, {}))
        problems += found
    fail_with(problems)
    return JobConfig(**built)


def _build_section(name: str, cls: type[_T], values: object) -> tuple[_T | None, list[str]]:
    """The section `name` from its TOML table, and its mistakes (then None). A value that the
    section's checks refuse is set back to its default and the checks run again, so that each
    refused value is named, not only the first."""
    if not isinstance(values, dict):
        return None, [f"[{name}] must be a table of keys, got {values!r}"]
    hints = typing.get_type_hints(cls)
    allowed = [f.name for f in dataclasses.fields(cls)]
    problems, typed = [], {}
    if bad := sorted(set(values) - set(allowed)):
        problems.append(f"unknown key(s) {bad} in [{name}]; allowed keys: {allowed}")
    for key in (k for k in values if k in allowed):
        try:
            typed[key] = _coerce(name, key, values[key], hints[key])
        except DistcacheConfigError as err:
            problems.append(str(err))
    while True:
        try:
            section = _section(name, cls, typed)
        except DistcacheConfigError as err:
            problems.append(str(err))
            refused = re.match(rf"\[{name}\] (\w+) = ", str(err))
            if refused is None or refused[1] not in typed:  # no value of this file to drop
                return None, problems
            del typed[refused[1]]
        else:
            return (None if problems else section), problems


def fail_with(problems: list[str]) -> None:
    """Raise one `DistcacheConfigError` naming every problem (one line), if there are any."""
    problems = list(dict.fromkeys(problems))  # a section checked again says the same
    if problems:
        numbered = " ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
        _fail(problems[0] if len(problems) == 1 else f"{len(problems)} mistakes: {numbered}")


def _section(name: str, cls: type[_T], values: dict[str, object]) -> _T:
    """`cls(**values)`; a component's own check (`CacheConfig.capacity=0.0 is invalid: ...`)
    is re-worded as the job's (`[cache] capacity = 0.0 is invalid: ...`)."""
    try:
        return cls(**values)
    except DistcacheConfigError as err:
        found = _COMPONENT_ERROR.fullmatch(str(err))
        if found is None or found["cls"] != cls.__name__:
            raise
        key, value, allowed = found["key"], found["value"], found["allowed"]
        raise DistcacheConfigError(
            f"[{name}] {key} = {value} is invalid: expected {allowed}"
        ) from None


def parse_overrides(overrides: list[str]) -> dict[str, dict[str, object]]:
    """`--section.key=value` arguments as nested dicts (values parsed as TOML)."""
    out: dict[str, dict[str, object]] = {}
    fail_with(
        [
            f"override {arg!r} is invalid: expected --section.key=value"
            for arg in overrides
            if "=" not in arg or "." not in arg.removeprefix("--").split("=", 1)[0]
        ]
    )
    for arg in overrides:
        text = arg.removeprefix("--")
        dotted, value = text.split("=", 1)
        section, key = dotted.split(".", 1)
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value  # a bare word: a string
        out.setdefault(section, {})[key] = parsed
    return out


def load_job_config(path: str | Path | None, overrides: list[str] = ()) -> JobConfig:
    """Read a TOML job config (None: all defaults) and apply `--section.key=value` overrides."""
    raw: dict[str, object] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            _fail(f"config file {str(path)!r} does not exist")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            _fail(f"config file {str(path)!r} is not valid TOML: {err}")
    for section, values in parse_overrides(list(overrides)).items():
        target = raw.setdefault(section, {})
        if not isinstance(target, dict):
            _fail(f"[{section}] must be a table of keys")
        target.update(values)
    return build_job_config(raw)


def dump_toml(config: JobConfig) -> str:
    """The resolved config as TOML (every key, defaults included; a None, which TOML cannot
    write, by leaving its key out: the default, chosen per device, e.g. `cache.staging`)."""
    lines = []
    for section in _SECTIONS:
        lines.append(f"[{section}]")
        for key, value in dataclasses.asdict(getattr(config, section)).items():
            if value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def parse_args(argv: list[str], command: str = "train") -> JobConfig:
    """The job config from `--config FILE`, `--resume` and `--section.key=value` overrides
    (`command`: 'train', or 'check', which takes the same arguments: its usage and errors).

    Example::

        config = parse_args(["--config", "configs/tiny_cpu.toml", "--train.steps=20"])
    """
    parser = argparse.ArgumentParser(
        prog=f"python -m distcache {command}",
        description="Train a DLRM with distcache's look-ahead caches."
        if command == "train"
        else "Check the arguments of `python -m distcache train`, its config and inputs, "
        "without training (silent when all is well).",
        epilog="Any config key can be overridden: --section.key=value (TOML values).",
    )
    parser.add_argument("--config", help="TOML job config (default: all defaults)")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        choices=("latest", "require", "never"),
        help="continue from the latest checkpoint; =require: fail if there is none; =never: "
        "start from step 0, moving the checkpoints found into superseded.N/",
    )
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not (o.startswith("--") and "." in o.split("=", 1)[0])]
    if bad:
        parser.error(f"unrecognized arguments {bad}: overrides are --section.key=value")
    config = load_job_config(args.config, overrides)
    if args.resume == "never":
        config = dataclasses.replace(
            config,
            checkpoint=dataclasses.replace(config.checkpoint, resume=False, start_over=True),
        )
    elif args.resume:
        require = config.checkpoint.require or args.resume == "require"
        config = dataclasses.replace(
            config,
            checkpoint=dataclasses.replace(config.checkpoint, resume=True, require=require),
        )
    return config


def job_topology(name: str, world_size: int) -> Topology:
    """A preset, or a topology JSON (`python -m distcache calibrate`) resized to the job."""
    if name in PRESETS:
        return preset(name, world_size=world_size)
    topology = load_topology(name)
    return dataclasses.replace(
        topology,
        world_size=world_size,
        ranks_per_node=min(topology.ranks_per_node, world_size),
    )


def plan_topology(config: JobConfig, world_size: int) -> Topology | None:
    """`[plan] topology` for a job of `world_size` ranks (`job_topology`); None when unset.

    Raises:
        DistcacheConfigError: it names no preset or file, or (planner 'torchrec', which places
            shards on its topology's device) a topology of another device than `[train]`'s.
    """
    name, device = config.plan.topology, config.train.device
    if not name:
        return None
    if name not in PRESETS and not Path(name).is_file():
        _fail(f"[plan] topology {name!r} is invalid: expected a preset {PRESETS} or a JSON file")
    topology = job_topology(name, world_size)
    if config.plan.planner == "torchrec" and topology.compute_device != device:
        _fail(
            f"[plan] topology {name!r} is a {topology.compute_device} topology: expected one "
            f"for [train] device = {device!r} (TorchRec places shards on its topology's device)"
        )
    return topology


def write_resolved_config(config: JobConfig) -> Path:
    """Write the resolved config to `<run dir>/resolved_config.toml`; returns its path."""
    run_dir = Path(config.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "resolved_config.toml"
    path.write_text(dump_toml(config))
    return path
