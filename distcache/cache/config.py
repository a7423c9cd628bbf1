"""`CacheConfig`: the settings of one table's (or one table group's) look-ahead cache."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from distcache.constants import DEFAULT_LOOKAHEAD, HOT_ALL, HOT_REDUCE
from distcache.errors import DistcacheConfigError

if TYPE_CHECKING:
    import torch

POLICIES = ("lookahead", "lru", "lfu")
STAGING = ("worker", "direct")
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
KERNELS = ("fbgemm", "torch")
#: distcache's optimizers that FBGEMM's TBE computes as distcache defines them -> FBGEMM's
#: name for each (`EmbOptimType`; `distcache.cache.tbe`).
TBE_OPTIMIZERS = {
    "sgd": "EXACT_SGD",
    "adagrad": "EXACT_ADAGRAD",
    "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD",
}


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """How a host-resident table is cached on the device.

    Example::

        CacheConfig(capacity=0.02, lookahead=8, prefetch_depth=2, optimizer="rowwise_adagrad",
                    learning_rate=0.05)
    """

    capacity: float | int = 1.0
    """Cache size per table. A float in (0, 1] is a fraction of the table's rows (rounded up); an
    int >= 1 is a number of rows (capped at the table's rows). Tables of one width share one
    cache, as large as their caches together; a table may set its own (`TableSpec.capacity`,
    or the sharder's `table_configs`): configs that differ only in capacity share the cache
    too, as TorchRec's UVM-cached tables of different load factors share one kernel."""
    lookahead: int = DEFAULT_LOOKAHEAD
    """L: how many future batches' ids the scheduler may see (>= 0). The scheduler's cost per
    batch does not grow with L; the window holds 21 bytes per id of each batch in it (plus
    the batches themselves, in a pipeline)."""
    prefetch_depth: int = 1
    """K: how many batches ahead of the training batch rows are staged (0 <= K <= L). The cache
    must hold the unique rows of K + 1 consecutive batches."""
    policy: str = "lookahead"
    """Eviction policy: 'lookahead' (future-aware), or the reactive 'lru' and 'lfu' baselines,
    which see no future batch and load their misses when the batch is looked up."""
    optimizer: str = "sgd"
    """Row-wise fused optimizer applied to cache rows in backward: one of OPTIMIZERS."""
    learning_rate: float = 0.01
    eps: float = 1e-8
    """Added to the denominator of Adagrad, row-wise Adagrad and Adam."""
    beta1: float = 0.9
    """Adam's first-moment decay."""
    beta2: float = 0.999
    """Adam's second-moment decay."""
    staging: str | None = None
    """How rows move between the host store and the cache, off the training thread: 'worker'
    (a thread waits for each plan's counts, gathers the missed rows into a host buffer and
    copies them over) or 'direct' (the staging stream copies rows between the cache and the
    page-locked host rows, which it addresses directly, each copy bounded by a count on the
    device: no thread waits; `distcache.cache.transfer`). None (the default): 'direct' on a
    CUDA device with Triton installed, 'worker' elsewhere: on a GPU, training waits on staging
    far less with 'direct' (benchmarks/results/README.md, "Results on a GPU"). On CPU both run
    on the training thread ('worker' copies the rows that move, 'direct' every padded entry):
    there is no device to wait for, and a second thread would compete for the cores of its
    OpenMP team."""
    kernel: str | None = None
    """What looks rows up and applies the fused optimizer in backward: 'fbgemm' (FBGEMM's
    table-batched embedding, TBE, run over the cache's slots: one forward and one backward
    kernel per cache, the optimizer fused, the cache its storage; `distcache.cache.tbe`) or
    'torch' (`F.embedding_bag` over the slots, the update by index_add_/index_copy_; SGD's in
    one C pass where `fused` runs the C kernels). Both compute the same update. None (the
    default): 'fbgemm' on a CPU for the stateful optimizers (Adagrad, row-wise Adagrad: its
    fused update is faster there) where FBGEMM's TBE computes them as distcache defines them
    for the cache's rows (a width that is a multiple of 4; fp32 or fp16 rows), else 'torch':
    for SGD (a scatter-add, which FBGEMM's Python wrapper outweighs on small batches) and on
    CUDA devices (there the wrapper and its backward launcher cost the host more than its
    kernels save the device: benchmarks/results/README.md, "Results on a GPU"). 'fbgemm' where
    it cannot serve (fbgemm_gpu without CUDA kernels on a GPU, Adam, bf16 rows, among others)
    is an error when the cache is built."""
    stochastic_rounding: bool | None = None
    """How fp16 and bf16 rows are rounded after their update (computed in fp32): True
    stochastically (up with the probability of the remainder over the gap between the two
    neighbours: unbiased, so an update smaller than half the gap still moves a row on
    average; `optimizers.round_stochastically`), False to nearest. None (the default): as
    FBGEMM's kernels, which TorchRec's `fused` runs: stochastically on CUDA (its
    `stochastic_rounding` fused param is True unless set), to nearest on CPU (FBGEMM's CPU
    kernels round to nearest whatever the param says). fp32 rows are not rounded."""
    check_ids: bool = True
    """Validate every batch's ids against the table sizes, on the device (no synchronization):
    a batch with an invalid id raises `InvalidIdError` when it is looked up, untrained."""
    cuda_graphs: bool | None = None
    """Replay a batch's routing and id checks and its scheduling (about 130 small kernels) as
    CUDA graphs captured for its size, so that the host launches three graphs instead of every
    kernel. The first batch of a size runs as usual, the second is captured (a device
    synchronization, once per size), later ones replay. Once batches come in more than one
    size (jagged features), each is padded to one of four sizes per doubling (at most a
    quarter more ids, routed to the sentinel row). A cache keeps 16 graphs; when sizes keep
    changing beyond that, it stops capturing (a warning says so). None (the default): on for a
    CUDA device, off elsewhere (on CPU an emulation replays the recorded ops, slower: for
    tests). On a GPU they save the host most of its launches, which otherwise set the pace
    (benchmarks/results/README.md, "Results on a GPU")."""
    fused: bool | None = None
    """Run the scheduler's per-batch passes that `distcache.cache.fused` has fused as a few
    kernels (a batch routed, where one cache serves every feature; entering the window; its
    rows looked up and placed, and a full cache's look-ahead victims chosen, when it is
    staged: 147 of a steady-state batch's routing and scheduling launches become 33), instead
    of torch's ops; the plans and the state are the same, bit for bit. On CUDA they are
    Triton's, compiled (Triton must be installed) and captured into the scheduler's graphs; on
    CPU they are C (`fused_native`, built on first use with the system's C compiler; Triton's
    interpreter where none is found) and run without graphs. None (the default): on for a CPU
    device without graph emulation where the C kernels build (with the torch ops a 5 % cache's
    DLRM step ran a fifth longer: benchmarks/results/README.md), off on CUDA until measured on
    a GPU."""
    scheduler_thread: bool = False
    """Run the cache's scheduling calls (a batch entering the window, staging ahead, releases)
    in order on a thread of their own (`distcache.cache.lane`): the training thread queues
    them and, where a batch is looked up, waits for the plan made while the batches before it
    trained. The plans are the same, bit for bit. On a GPU the host sets a step's pace and the
    scheduler's host work is 1.4-1.9 ms of a 6.3 ms step (an H200,
    benchmarks/results/h200_2026-11-28); on its own thread it can overlap the training
    thread's launches as far as Python's GIL lets them interleave. Off by default: not yet
    measured on a GPU. On CPU it competes with the training thread for the cores."""
    hot_rows: tuple[int, ...] = ()
    """Rows of a sharded table replicated on every rank (global row ids, e.g. its hottest):
    their lookups stay on the rank (no all-to-all, no cache slot), their gradients are summed
    across ranks and applied with the same row optimizer. Only for distcache-sharded tables
    (`distcache.sharding.hot_rows`); () for none."""
    hot_reduce: str = HOT_ALL
    """How the hot rows' gradients are summed across ranks each step: 'all' (one all-reduce of
    every hot row's gradient) or 'touched' (an all-gather of only the rows each rank touched:
    cheaper when a rank's batch touches few of the hot rows). The planner chooses it by its
    cost model (`TablePlan.hot_reduce`); the update is the same either way."""

    def __post_init__(self) -> None:
        hot = self.hot_rows
        if not isinstance(hot, tuple):
            hot = tuple(hot) if isinstance(hot, list | range) else hot
            object.__setattr__(self, "hot_rows", hot)
        if not isinstance(hot, tuple) or any(
            isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in hot
        ):
            _fail("hot_rows", _short(hot), "a tuple of distinct row ids >= 0")
        if len(set(hot)) != len(hot):
            _fail("hot_rows", _short(hot), "distinct row ids (some repeat)")
        check_capacity(self.capacity, "CacheConfig.capacity")
        _check_int("lookahead", self.lookahead, 0)
        _check_int("prefetch_depth", self.prefetch_depth, 0)
        if self.prefetch_depth > self.lookahead:
            _fail(
                "prefetch_depth",
                self.prefetch_depth,
                f"at most lookahead={self.lookahead} (rows are staged only for batches whose "
                "ids are known)",
            )
        if self.policy not in POLICIES:
            _fail("policy", self.policy, f"one of {POLICIES}")
        if self.hot_reduce not in HOT_REDUCE:
            _fail("hot_reduce", self.hot_reduce, f"one of {HOT_REDUCE}")
        if self.staging is not None and self.staging not in STAGING:
            _fail("staging", self.staging, f"one of {STAGING}, or None (direct for CUDA)")
        if self.optimizer not in OPTIMIZERS:
            _fail("optimizer", self.optimizer, f"one of {OPTIMIZERS}")
        if self.kernel is not None and self.kernel not in KERNELS:
            _fail("kernel", self.kernel, f"one of {KERNELS}, or None (fbgemm where it can)")
        if self.kernel == "fbgemm" and self.optimizer not in TBE_OPTIMIZERS:
            _fail(
                "kernel",
                self.kernel,
                f"'torch' or None with optimizer={self.optimizer!r}: FBGEMM's TBE runs "
                f"{tuple(TBE_OPTIMIZERS)} as distcache defines them",
            )
        if not (self.stochastic_rounding is None or isinstance(self.stochastic_rounding, bool)):
            _fail(
                "stochastic_rounding",
                self.stochastic_rounding,
                "True, False, or None (as FBGEMM: on CUDA devices)",
            )
        if not isinstance(self.check_ids, bool):
            _fail("check_ids", self.check_ids, "True or False")
        if self.fused is not None and not isinstance(self.fused, bool):
            _fail("fused", self.fused, "True, False or None (the device's default)")
        if not isinstance(self.scheduler_thread, bool):
            _fail("scheduler_thread", self.scheduler_thread, "True or False")
        if not (self.cuda_graphs is None or isinstance(self.cuda_graphs, bool)):
            _fail("cuda_graphs", self.cuda_graphs, "True, False, or None (on for CUDA devices)")
        for name in ("learning_rate", "eps"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                _fail(name, value, "a finite number >= 0")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0.0 <= value < 1.0):
                _fail(name, value, "a number in [0, 1)")

    def capacity_rows(self, num_rows: int) -> int:
        """The cache size in rows for a table (or table group) of `num_rows` rows."""
        if isinstance(self.capacity, float):
            return max(1, min(num_rows, math.ceil(self.capacity * num_rows)))
        return min(num_rows, self.capacity)

    def staging_on(self, device: torch.device) -> str:
        """The staging design used on `device` (`staging`): by default 'direct' on CUDA where
        Triton is installed (without it, direct staging copies every padded entry across the
        host link), else 'worker'."""
        if self.staging is None:
            return "direct" if device.type == "cuda" and triton_installed() else "worker"
        return self.staging

    def rounds_stochastically(self, device: torch.device) -> bool:
        """Whether half rows are rounded stochastically on `device` (`stochastic_rounding`)."""
        if self.stochastic_rounding is None:
            return device.type == "cuda"
        return self.stochastic_rounding

    def graphs_on(self, device: torch.device) -> bool:
        """Whether the per-batch work replays as graphs on `device` (`cuda_graphs`)."""
        return device.type == "cuda" if self.cuda_graphs is None else self.cuda_graphs

    def fused_on(self, device: torch.device) -> bool:
        """Whether the scheduler's passes run as fused kernels on `device` (`fused`)."""
        if self.fused is not None:
            return self.fused
        if device.type != "cpu" or self.graphs_on(device):
            return False
        # Here, not at the top: the planner imports this module, and the plan command no torch.
        from distcache.cache import fused_native

        return fused_native.load() is not None  # (builds the C kernels the first time)

    @property
    def is_reactive(self) -> bool:
        """True for policies that use no knowledge of future batches."""
        return self.policy != "lookahead"


def triton_installed() -> bool:
    """Whether Triton can be imported (direct staging's CUDA kernel needs it)."""
    return importlib.util.find_spec("triton") is not None


def check_capacity(capacity: object, where: str) -> None:
    """Raise `DistcacheConfigError` naming `where` unless `capacity` is a `CacheConfig.capacity`:
    a float in (0, 1] or an int >= 1."""
    allowed = None
    if isinstance(capacity, bool) or not isinstance(capacity, int | float):
        allowed = "a float in (0, 1] (fraction of rows) or an int >= 1 (rows)"
    elif isinstance(capacity, float) and not (0.0 < capacity <= 1.0 and math.isfinite(capacity)):
        allowed = "a fraction in (0, 1], or an int >= 1 for a number of rows"
    elif isinstance(capacity, int) and capacity < 1:
        allowed = "an int >= 1 (rows), or a float in (0, 1] (fraction of rows)"
    if allowed:
        raise DistcacheConfigError(f"{where}={capacity!r} is invalid: expected {allowed}")


def _short(value: object) -> object:
    """A long tuple, shortened for an error message."""
    if isinstance(value, tuple) and len(value) > 8:
        return f"({', '.join(map(repr, value[:8]))}, ... {len(value)} in all)"
    return value


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(name, value, f"an int >= {minimum}")


def _fail(name: str, value: object, allowed: str) -> None:
    raise DistcacheConfigError(f"CacheConfig.{name}={value!r} is invalid: expected {allowed}")
