"""Speed and device memory of the cache engine on this machine, each next to its baseline.

1. Scheduler: ids/s and host ms per batch of the scheduler and stager (dedup, window, victims,
   residency, the worker hand-off; zero-width rows, so no bytes move) on one large shard with a
   2 % cache and big power-law batches, at L = 8, 64, 256 (its cost must not grow with L), and
   the reactive LRU engine.
2. Forward + backward: steps/s of `CachedEmbeddingBags` (look-ahead window, fused SGD) at 100,
   5 and 1 % of the rows, with fp16 rows at 5 % (bytes staged per row: half), with direct
   staging at 5 % (`staging="direct"`: copies on the training thread here), and reactive LRU
   at 5 % (on CUDA also `cuda_graphs` at 5 %, with the worker thread and with direct staging:
   the CUDA defaults), next to `torch.nn.EmbeddingBag` with sparse
   gradients + `torch.optim.SGD` on the same batches and sizes; host ms per step spent
   scheduling (enqueue + prefetch) and waiting for rows.
3. Device bytes per table row of each policy, measured (engines of two sizes, same cache) and
   applied to Criteo Terabyte's 26 tables.
4. Ops per step: the ops that launch work (not views, allocations or Python-number wrappers),
   counted in steady state under a `TorchDispatchMode`, for the forward + backward variants at
   100 and 5 % and `nn.EmbeddingBag` + SGD: on CUDA each is a kernel launch on the training
   thread, so this is the host's launch work per batch. "graphs": the 5 % variant with
   `cuda_graphs` ("graphs direct": and direct staging, the CUDA defaults), a replayed graph
   counted as one launch (on CPU too, where an emulation
   dispatches its ops again; section 5's time for it there is the emulation's, not a GPU's).
   "fused": the 5 % variant with the scheduler's fused passes (`CacheConfig.fused`, without
   graphs: every launch counted), each Triton kernel launch counted as one (where Triton is
   installed; on CPU its interpreter runs them). Section 4 only.
5. Host time per step: the forward + backward variants of section 4 at a size where compute is
   negligible (--host-rows x 16, --host-batch bags of one id, one torch thread), interleaved
   step by step: what the host spends dispatching a step, which on CUDA it must spend too.
   Sections 4 and 5 report the evictions per counted step: at 5 % they must be steady-state
   steps (the cache full, choosing victims), not steps that only fill free slots.
6. Capacity: the scheduler's time per batch (as in 1; synchronized on CUDA) on one table
   (--sched-rows) at each of --cap-fractions of its rows, each cache first filled with rows the
   trace rarely needs so that every timed batch evicts: a batch's cost must follow the batch,
   not the cache's size ("x fastest" near 1).
Sections 1 and 6 run the scheduler as `CacheConfig.fused` has it by default (on CPU the C
kernels of its fused passes where a C compiler builds them; on CUDA the torch ops); --fused runs
the fused passes (compiled Triton kernels on CUDA), --no-fused the torch ops.

On CPU the process keeps freed host memory for reuse, as distcache's CPU ranks do
(`distcache.job.host_memory`; DISTCACHE_KEEP_FREED_MEMORY=0: glibc's defaults).

Variants run step by step in turn, in an order rotated every step, so that this shared
machine's drift touches them alike; each of --rounds rounds gives one steps/s (ids/s) per
variant, and the tables report the median and range over rounds. A variant's step ends when its
staging worker is idle (what it staged overlaps the step's backward, not another variant's
step).

Usage::

    python benchmarks/engine_throughput.py --json benchmarks/results/engine_throughput.json
    python benchmarks/engine_throughput.py --quick      # small sizes, a smoke run
    python benchmarks/engine_throughput.py --device cuda --skip bytes   # on a GPU

With --device cuda the caches, the baseline and the batches live on the GPU (host stores in
page-locked host memory) and every timed step ends with the device synchronized, so a step's
time is its host and device time; the scheduler section replays its trace there too.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table, write_json  # noqa: E402

from distcache import CacheConfig, CachedEmbeddingBags, TableSpec  # noqa: E402
from distcache.cache import fused as fused_passes  # noqa: E402
from distcache.cache import graphs  # noqa: E402
from distcache.cache.engine import CacheEngine  # noqa: E402
from distcache.data.traces import zipf_trace  # noqa: E402
from distcache.job.host_memory import keep_freed_memory  # noqa: E402
from distcache.planner.workloads import workload_preset  # noqa: E402

TARGET_IDS_PER_S = 5e6  # issue 11: scheduler ids/s on CPU
TARGET_X_FULL = 0.9  # ... forward + backward at 5 % against 100 %


def interleave(steps: dict[str, Callable[[], None]], rounds: int, per_round: int, warmup: int):
    """Run every variant's step in turn (order rotated each step); returns per variant the
    seconds per step of each round."""
    names = list(steps)
    for i in range(warmup):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            steps[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        spent = dict.fromkeys(names, 0.0)
        for i in range(per_round):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                start = time.perf_counter()
                steps[name]()
                spent[name] += time.perf_counter() - start
        for name in names:
            times[name].append(spent[name] / per_round)
    return times


def summary(per_step_s: list[float], work: float) -> dict[str, float]:
    """Median and range over rounds of `work` per second."""
    rates = [work / s for s in per_step_s]
    return {"median": statistics.median(rates), "low": min(rates), "high": max(rates)}


class Replay:
    """One engine replaying a cyclic trace as the pipeline drives it: L batches enqueued ahead,
    K staged ahead, then look-up and release (zero-width rows: no bytes move)."""

    def __init__(
        self,
        trace,
        rows: int,
        capacity: int,
        policy: str,
        lookahead: int,
        device: str = "cpu",
        fused: bool | None = None,
    ):
        config = CacheConfig(
            capacity=capacity,
            lookahead=lookahead,
            prefetch_depth=1 if policy == "lookahead" else 0,
            policy=policy,
            fused=fused,
        )
        self.engine = CacheEngine(
            num_rows=rows, dim=0, config=config, capacity=capacity, device=device
        )
        self.trace, self.lookahead = [ids.to(device) for ids in trace], lookahead
        self.t = self.enqueued = 0
        self.no_grad = torch.zeros(1, 0, device=device)
        self.sync = _synchronizer(device)
        self.host_s = 0.0

    def prefill(self, rows: torch.Tensor) -> None:
        """Fill the cache with `rows` (one batch through the engine) before the trace."""
        engine = self.engine
        engine.enqueue(rows)
        engine.prefetch()
        plan = engine.lookup_plan()
        engine.apply_gradients(plan, self.no_grad, torch.zeros_like(plan.batch.ids))
        engine.stager.drain()
        self.sync()
        self.filled = engine.stats()  # the counters the timed batches are measured from

    def step(self) -> None:
        engine = self.engine
        while self.enqueued <= self.t + self.lookahead:
            engine.enqueue(self.trace[self.enqueued % len(self.trace)])
            self.enqueued += 1
        engine.prefetch()
        plan = engine.lookup_plan()
        engine.prefetch()
        engine.apply_gradients(plan, self.no_grad, torch.zeros_like(plan.batch.ids))
        engine.stager.drain()
        self.sync()
        self.t += 1


def _sched_trace(args, batch: int, seed: int) -> list[torch.Tensor]:
    """--sched-batches power-law batches of `batch` ids over --sched-rows rows (cycled)."""
    trace = zipf_trace(
        rows=args.sched_rows, alpha=args.alpha, batch=batch, batches=args.sched_batches, seed=seed
    )
    return list(trace)


def bench_scheduler(args) -> list[dict]:
    trace = _sched_trace(args, args.sched_batch, seed=0)
    capacity = int(args.sched_capacity * args.sched_rows)
    variants = {f"lookahead L={la}": ("lookahead", la) for la in (8, 64, 256)}
    variants["lru"] = ("lru", 64)
    replays = {
        name: Replay(trace, args.sched_rows, capacity, policy, la, args.device, args.fused)
        for name, (policy, la) in variants.items()
    }
    # Warm-up fills the windows (L + 1 batches on the first step) and the caches.
    times = interleave(
        {n: r.step for n, r in replays.items()}, args.rounds, args.sched_steps, args.sched_warmup
    )
    results = []
    for name, replay in replays.items():
        stats = replay.engine.stats()
        ids = summary(times[name], args.sched_batch)
        results.append(
            {
                "bench": "scheduler",
                "variant": name,
                "rows": args.sched_rows,
                "capacity": capacity,
                "batch_ids": args.sched_batch,
                "hit_rate": stats.hit_rate,
                "ids_per_s": ids["median"],
                "ids_per_s_low": ids["low"],
                "ids_per_s_high": ids["high"],
                "ms_per_batch": 1e3 * statistics.median(times[name]),
            }
        )
    return results


def bench_capacity(args) -> list[dict]:
    """Section 6: the scheduler's time per batch at several cache sizes of one table, each cache
    first filled with rows the batches do not need, so every timed batch evicts."""
    trace = _sched_trace(args, args.cap_batch, seed=2)
    replays = {}
    for fraction in (float(f) for f in args.cap_fractions.split(",")):
        capacity = int(fraction * args.sched_rows)
        replay = Replay(
            trace, args.sched_rows, capacity, "lookahead", args.lookahead, args.device, args.fused
        )
        replay.prefill(torch.randperm(args.sched_rows)[:capacity].to(args.device))
        replays[f"{100 * fraction:g} %"] = replay
    times = interleave(
        {n: r.step for n, r in replays.items()}, args.rounds, args.sched_steps, args.sched_warmup
    )
    results = []
    for name, replay in replays.items():
        stats, filled = replay.engine.stats(), replay.filled
        unique = stats.unique - filled.unique
        results.append(
            {
                "bench": "capacity",
                "variant": name,
                "rows": args.sched_rows,
                "capacity": replay.engine.capacity,
                "batch_ids": args.cap_batch,
                "lookahead": args.lookahead,
                "hit_rate": (stats.hits - filled.hits) / max(1, unique),
                "evictions_per_batch": (stats.evictions - filled.evictions)
                / max(1, stats.batches - filled.batches),
                "ms_per_batch": 1e3 * statistics.median(times[name]),
                "ms_per_batch_low": 1e3 * min(times[name]),
                "ms_per_batch_high": 1e3 * max(times[name]),
            }
        )
    fastest = min(r["ms_per_batch"] for r in results)
    for r in results:
        r["x_fastest"] = r["ms_per_batch"] / fastest
    return results


def _batches(args) -> list[tuple[torch.Tensor, torch.Tensor]]:
    n = args.batch_size * args.pooling
    trace = zipf_trace(rows=args.rows, alpha=args.alpha, batch=n, batches=args.pool, seed=1)
    offsets = torch.arange(0, n + 1, args.pooling).to(args.device)
    return [(ids.to(args.device), offsets) for ids in trace]


def _synchronizer(device: str) -> Callable[[], None]:
    """What ends a timed step: the device synchronized on CUDA, nothing on CPU."""
    if torch.device(device).type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class Baseline:
    """`nn.EmbeddingBag` with sparse gradients and SGD: every row in memory, no cache."""

    def __init__(self, args, batches):
        self.bag = torch.nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True)
        self.bag.to(args.device)
        self.opt = torch.optim.SGD(self.bag.parameters(), lr=0.01)
        self.batches, self.t = batches, 0
        self.sync = _synchronizer(args.device)

    def step(self) -> None:
        values, offsets = self.batches[self.t % len(self.batches)]
        self.opt.zero_grad()
        self.bag(values, offsets[:-1]).sum().backward()
        self.opt.step()
        self.sync()
        self.t += 1


class Cached:
    """`CachedEmbeddingBags` driven as the pipeline drives it (L ahead, K = 1 staged)."""

    def __init__(
        self,
        args,
        batches,
        capacity: float,
        policy: str,
        dtype: torch.dtype = torch.float32,
        staging: str = "worker",
        graphs: bool = False,
        fused: bool = False,
    ):
        self.config = CacheConfig(
            capacity=capacity,
            lookahead=args.lookahead,
            prefetch_depth=1 if policy == "lookahead" else 0,
            policy=policy,
            learning_rate=0.01,
            staging=staging,
            cuda_graphs=graphs,
            fused=fused,
        )
        table = TableSpec(name="t", num_embeddings=args.rows, embedding_dim=args.dim, dtype=dtype)
        self.bags = CachedEmbeddingBags([table], self.config, device=args.device)
        self.batches, self.t, self.enqueued = batches, 0, 0
        self.schedule_s = 0.0
        self.sync = _synchronizer(args.device)

    def evictions(self) -> int:
        """Rows evicted so far (reads the device: not per step)."""
        (stats,) = self.bags.stats().values()
        return stats.evictions

    def step(self) -> None:
        bags, n = self.bags, len(self.batches)
        start = time.perf_counter()
        while self.enqueued <= self.t + self.config.lookahead:
            bags.enqueue(*self.batches[self.enqueued % n])
            self.enqueued += 1
        bags.prefetch()
        self.schedule_s += time.perf_counter() - start
        out = bags(*self.batches[self.t % n])
        start = time.perf_counter()
        bags.prefetch()
        self.schedule_s += time.perf_counter() - start
        out.sum().backward()
        for group in bags._groups:  # the worker's staging, within this step
            group.engine.stager.drain()
        self.sync()
        self.t += 1


def bench_forward_backward(args) -> list[dict]:
    batches = _batches(args)
    variants: dict[str, Baseline | Cached] = {"nn.EmbeddingBag": Baseline(args, batches)}
    for cap in (float(c) for c in args.capacities.split(",")):
        variants[f"distcache {cap:g}"] = Cached(args, batches, cap, "lookahead")
    variants["distcache 0.05 fp16"] = Cached(args, batches, 0.05, "lookahead", torch.float16)
    variants["distcache 0.05 direct"] = Cached(args, batches, 0.05, "lookahead", staging="direct")
    if args.device == "cuda":  # (on CPU its time would be the graphs' emulation's)
        variants["distcache 0.05 graphs"] = Cached(args, batches, 0.05, "lookahead", graphs=True)
        variants["distcache 0.05 graphs direct"] = _cuda_defaults(args, batches)
    variants["lru 0.05"] = Cached(args, batches, 0.05, "lru")
    warmup = args.warmup + args.lookahead  # the first step fills the window
    times = interleave({n: v.step for n, v in variants.items()}, args.rounds, args.steps, warmup)
    steps_total = warmup + args.rounds * args.steps
    base = summary(times["nn.EmbeddingBag"], 1.0)["median"]
    full_name = next((n for n in variants if n == "distcache 1"), None)
    full = summary(times[full_name], 1.0)["median"] if full_name else None
    results = []
    for name, v in variants.items():
        rate = summary(times[name], 1.0)
        row = {
            "bench": "fwd+bwd",
            "variant": name,
            "steps_per_s": rate["median"],
            "steps_per_s_low": rate["low"],
            "steps_per_s_high": rate["high"],
            "x_embedding_bag": rate["median"] / base,
            "x_full_cache": rate["median"] / full if full else None,
        }
        if isinstance(v, Cached):
            (stats,) = v.bags.stats().values()
            row |= {
                "capacity_frac": v.config.capacity,
                "row_dtype": str(v.bags.tables[0].dtype).removeprefix("torch."),
                "staging": v.config.staging,
                "bytes_staged_per_row": stats.bytes_loaded / stats.loads if stats.loads else 0,
                "hit_rate": stats.hit_rate,
                "critical_misses": stats.critical_misses,
                "schedule_ms_per_step": 1e3 * v.schedule_s / steps_total,
                "wait_ms_per_step": 1e3 * stats.wait_s / steps_total,
            }
        results.append(row)
    return results


class _LaunchCount(TorchDispatchMode):
    """Counts dispatched ops that launch work: not views, allocations, or the 0-dim host
    tensors that wrap Python numbers."""

    SKIP = ("aten::empty", "aten::empty_strided", "aten::detach", "aten::lift_fresh",
            "aten::scalar_tensor")  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if not func.is_view and func._schema.name not in self.SKIP and not graphs.replaying():
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _launch_variants(args) -> dict[str, Baseline | Cached]:
    """The variants of sections 4 and 5: nn.EmbeddingBag + SGD, distcache at 100 and 5 %, LRU
    at 5 %, on the batches `args` describes."""
    batches = _batches(args)
    variants: dict[str, Baseline | Cached] = {"nn.EmbeddingBag": Baseline(args, batches)}
    for cap in (1.0, 0.05):
        variants[f"distcache {cap:g}"] = Cached(args, batches, cap, "lookahead")
    # The scheduler replayed as CUDA graphs (on CPU an emulation: slower, for tests).
    variants["distcache 0.05 graphs"] = Cached(args, batches, 0.05, "lookahead", graphs=True)
    variants["distcache 0.05 graphs direct"] = _cuda_defaults(args, batches)
    variants["lru 0.05"] = Cached(args, batches, 0.05, "lru")
    return variants


def _cuda_defaults(args, batches) -> Cached:
    """The 5 % cache as CUDA runs it by default: graphs and direct staging."""
    return Cached(args, batches, 0.05, "lookahead", staging="direct", graphs=True)


def bench_ops(args) -> list[dict]:
    """Ops per steady-state step of the forward + backward variants (section 4), and of the 5 %
    cache with the scheduler's fused passes (`CacheConfig.fused`, where Triton is installed:
    each kernel launch counts one; on CPU Triton's kernels, interpreted, not the C ones: the
    count is what a GPU launches)."""
    variants = _launch_variants(args)
    kernels: list[int] = [0]
    if args.device == "cuda" or importlib.util.find_spec("triton") is not None:
        kept, fused_passes.CPU_KERNELS = fused_passes.CPU_KERNELS, "triton"
        try:
            fused = Cached(args, _batches(args), 0.05, "lookahead", fused=True)
        finally:
            fused_passes.CPU_KERNELS = kept
        kernels = _count_kernels(fused)
        variants["distcache 0.05 fused"] = fused
    results = []
    for name, variant in variants.items():
        for _ in range(args.warmup + args.lookahead):  # the window and the cache full
            variant.step()
        evicted, replays, launched = _evictions(variant), _replays(variant), kernels[0]
        count = _LaunchCount()
        with count:
            for _ in range(args.steps):
                variant.step()
        launches = count.ops + _replays(variant) - replays  # a replayed graph: one launch
        launches += kernels[0] - launched  # (the fused kernels', 0 for the other variants)
        results.append(
            {
                "bench": "ops",
                "variant": name,
                "ops_per_step": launches / args.steps,
                "evictions_per_step": _per_step(_evictions(variant), evicted, args.steps),
            }
        )
    return results


def _count_kernels(variant: Cached) -> list[int]:
    """Make each launch of `variant`'s fused kernels count in the returned `[launches]` and run
    outside dispatch modes: one launch each, whatever it runs (Triton's interpreter, on CPU,
    dispatches torch ops of its own, which `_LaunchCount` must not count)."""
    launched = [0]

    class Counted:
        def __init__(self, kernel) -> None:  # noqa: ANN001
            self.kernel = kernel

        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                launched[0] += 1
                with _disable_current_modes():
                    return self.kernel[grid](*args, **kwargs)

            return launch

    def counted(kernels: dict | None) -> dict | None:
        return None if kernels is None else {k: Counted(v) for k, v in kernels.items()}

    bags = variant.bags
    bags._router.kernels = counted(bags._router.kernels)
    for group in bags._groups:
        scheduler = group.engine.scheduler
        scheduler._kernels = scheduler.victims.kernels = counted(scheduler._kernels)
    return launched


def _replays(variant: Baseline | Cached) -> int:
    """Graphs the variant replayed so far (`cuda_graphs`): its routing's and its caches'."""
    if not isinstance(variant, Cached):
        return 0
    bags = variant.bags
    scheduling = sum(g.engine.scheduler.graphs.replays for g in bags._groups)
    return bags._router.graphs.replays + scheduling


def _evictions(variant: Baseline | Cached) -> int | None:
    """Rows the variant's cache evicted so far (None: no cache)."""
    return variant.evictions() if isinstance(variant, Cached) else None


def _per_step(now: int | None, before: int | None, steps: int) -> float | None:
    return None if now is None or before is None else (now - before) / steps


def bench_host(args) -> list[dict]:
    """Host ms per step at negligible compute (section 5)."""
    small = argparse.Namespace(**vars(args))
    small.rows, small.dim, small.batch_size, small.pooling = args.host_rows, 16, args.host_batch, 1
    variants = _launch_variants(small)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        warmup = args.warmup + args.lookahead
        steps = {n: v.step for n, v in variants.items()}
        interleave(steps, 0, 0, warmup)
        evicted = {n: _evictions(v) for n, v in variants.items()}
        times = interleave(steps, args.rounds, 20 * args.steps, 0)
    finally:
        torch.set_num_threads(threads)
    results = []
    timed = args.rounds * 20 * args.steps
    for name, variant in variants.items():
        rate = summary(times[name], 1.0)  # steps/s
        now = _evictions(variant)
        results.append(
            {
                "bench": "host",
                "variant": name,
                "rows": small.rows,
                "batch_ids": small.batch_size,
                "ms_per_step": 1e3 / rate["median"],
                "ms_per_step_low": 1e3 / rate["high"],
                "ms_per_step_high": 1e3 / rate["low"],
                "evictions_per_step": _per_step(now, evicted[name], timed),
            }
        )
    return results


def bench_device_bytes(args) -> list[dict]:
    """Device bytes per table row: engines of two sizes with the same cache, the difference
    of their device tensors (maps, window, policy state) divided by the difference of rows."""
    tb_rows = sum(t.rows for t in workload_preset("criteo-terabyte").tables)
    lo, hi, cap = 1_000_000, 3_000_000, 10_000
    results = []
    for policy in ("lookahead", "lru", "lfu"):
        sizes = []
        for rows in (lo, hi):
            config = CacheConfig(capacity=cap, policy=policy)
            engine = CacheEngine(num_rows=rows, dim=0, config=config)
            sizes.append(_device_bytes(engine))
        per_row = (sizes[1] - sizes[0]) / (hi - lo)
        results.append(
            {
                "bench": "device bytes",
                "variant": policy,
                "bytes_per_row": per_row,
                "criteo_tb_rows": tb_rows,
                "criteo_tb_gb": per_row * tb_rows / 1e9,
            }
        )
    return results


def _device_bytes(engine: CacheEngine) -> int:
    """Bytes of every tensor the engine keeps on its device (not the host store)."""
    seen, total = set(), 0
    stack = [engine.scheduler, engine.scheduler.residency, engine.scheduler.window]
    stack.append(engine.scheduler.policy)
    for obj in stack:
        for value in vars(obj).values():
            if isinstance(value, torch.Tensor) and value.data_ptr() not in seen:
                seen.add(value.data_ptr())
                total += value.numel() * value.element_size()
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--alpha", type=float, default=1.05)
    ap.add_argument("--sched-rows", type=int, default=40_000_000)
    ap.add_argument("--sched-capacity", type=float, default=0.02)
    ap.add_argument("--sched-batch", type=int, default=200_000)
    ap.add_argument("--sched-batches", type=int, default=64, help="distinct batches (cycled)")
    ap.add_argument("--sched-warmup", type=int, default=12)
    ap.add_argument("--sched-steps", type=int, default=8, help="steps per round")
    ap.add_argument("--cap-fractions", default="0.01,0.05,0.2", help="section 6's caches")
    ap.add_argument("--cap-batch", type=int, default=100_000, help="section 6's ids per batch")
    ap.add_argument("--rows", type=int, default=5_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--pooling", type=int, default=16)
    ap.add_argument("--pool", type=int, default=80, help="distinct batches (cycled)")
    ap.add_argument("--lookahead", type=int, default=CacheConfig().lookahead)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=10, help="steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--capacities", default="1.0,0.05,0.01")
    ap.add_argument(
        "--host-rows",
        type=int,
        default=20_000,
        help="section 5's table rows (its 5 %% cache must be smaller than the rows its "
        "batches use, so that its steps evict)",
    )
    ap.add_argument("--host-batch", type=int, default=64, help="section 5's ids per batch")
    ap.add_argument(
        "--skip", default="", help="sections to skip: scheduler,fwd,bytes,ops,host,capacity"
    )
    ap.add_argument(
        "--fused",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sections 1 and 6: the scheduler's fused passes (CacheConfig.fused; default: per"
        "\ndevice, on CPU the C kernels where a C compiler builds them)",
    )
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    # As distcache's CPU ranks do (`process_group`): freed host memory reused, not faulted in
    # again (with glibc's defaults the variants' steps page-faulted 400-1,800 times each here).
    args.keep_freed_memory = args.device == "cpu" and keep_freed_memory()
    if args.quick:
        args.sched_rows, args.sched_batch, args.sched_batches = 200_000, 1_000, 10
        args.cap_batch = 1_000
        args.sched_warmup, args.sched_steps = 3, 2
        args.rows, args.batch_size, args.pool, args.lookahead = 200_000, 32, 12, 4
        args.warmup, args.steps, args.rounds = 2, 2, 2
    skip = set(args.skip.split(","))
    results = []
    if "scheduler" not in skip:
        sched = bench_scheduler(args)
        print(f"scheduler (no rows moved), median [range] of {args.rounds} rounds:")
        print_table(
            sched,
            [
                ("variant", "variant"),
                ("rows", "rows"),
                ("capacity", "cache rows"),
                ("batch_ids", "ids/batch"),
                ("hit_rate", "hit rate"),
                ("ms_per_batch", "ms/batch"),
                ("ids_per_s", "ids/s"),
                ("ids_per_s_low", "low"),
                ("ids_per_s_high", "high"),
            ],
        )
        results += sched
    if "capacity" not in skip:
        cap = bench_capacity(args)
        print(
            f"\nscheduler at several cache sizes ({args.sched_rows:,} rows, {args.cap_batch:,} "
            f"ids a batch, L={args.lookahead}, caches full), median [range] of {args.rounds} "
            "rounds:"
        )
        print_table(
            cap,
            [
                ("variant", "cache"),
                ("capacity", "cache rows"),
                ("hit_rate", "hit rate"),
                ("evictions_per_batch", "evictions/batch"),
                ("ms_per_batch", "ms/batch"),
                ("ms_per_batch_low", "low"),
                ("ms_per_batch_high", "high"),
                ("x_fastest", "x fastest"),
            ],
        )
        results += cap
    if "fwd" not in skip:
        fwd = bench_forward_backward(args)
        print(
            f"\nforward+backward: {args.rows:,} rows x {args.dim}, batch {args.batch_size} bags x "
            f"{args.pooling} ids, zipf alpha {args.alpha}, L={args.lookahead} K=1, "
            f"{args.rounds} rounds of {args.steps} steps after {args.warmup}"
        )
        print_table(
            fwd,
            [
                ("variant", "variant"),
                ("hit_rate", "hit rate"),
                ("critical_misses", "critical misses"),
                ("steps_per_s", "steps/s"),
                ("steps_per_s_low", "low"),
                ("steps_per_s_high", "high"),
                ("x_embedding_bag", "x nn.EmbeddingBag"),
                ("x_full_cache", "x distcache 100 %"),
                ("schedule_ms_per_step", "schedule ms/step"),
                ("wait_ms_per_step", "wait ms/step"),
                ("bytes_staged_per_row", "bytes staged/row"),
            ],
        )
        results += fwd
    if "ops" not in skip:
        ops = bench_ops(args)
        print(f"\nops that launch work, per steady-state step ({args.steps} steps counted):")
        print_table(
            ops,
            [
                ("variant", "variant"),
                ("ops_per_step", "ops/step"),
                ("evictions_per_step", "evictions/step"),
            ],
        )
        results += ops
    if "host" not in skip:
        host = bench_host(args)
        print(
            f"\nhost ms per step at negligible compute ({args.host_rows:,} rows x 16, "
            f"{args.host_batch} ids a batch, 1 thread), median [range] of {args.rounds} rounds:"
        )
        print_table(
            host,
            [
                ("variant", "variant"),
                ("ms_per_step", "ms/step"),
                ("ms_per_step_low", "low"),
                ("ms_per_step_high", "high"),
                ("evictions_per_step", "evictions/step"),
            ],
        )
        results += host
    if "bytes" not in skip:
        sizes = bench_device_bytes(args)
        print("\ndevice memory per table row (maps, window, policy; measured):")
        print_table(
            sizes,
            [
                ("variant", "policy"),
                ("bytes_per_row", "bytes/row"),
                ("criteo_tb_rows", "Criteo TB rows"),
                ("criteo_tb_gb", "GB for Criteo TB"),
            ],
        )
        results += sizes
    write_json(args.json, vars(args), results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
