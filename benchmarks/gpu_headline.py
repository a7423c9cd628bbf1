"""Issue 7's headline: Criteo Terabyte-sized tables trained on one device through a 1-2 % cache.

The model: 26 tables of Criteo Terabyte's sizes (MLPerf DLRM, 187.8 M rows; --tables kaggle:
Kaggle's, 33.8 M) / --scale, dim 64, one power-law id per feature per sample (as in Criteo), a
small DLRM dense part in plain torch (bottom MLP, dot interaction, top MLP) trained with SGD, the
embeddings with --optimizer: SGD (no per-row optimizer state) or row-wise Adagrad (one
accumulator per row, distcache's `RowWiseAdagrad`, FBGEMM's `EXACT_ROWWISE_ADAGRAD`, eps 1e-8).
At --scale 1 the rows take 48 GB of host memory (page-locked on CUDA by `cudaHostRegister`, with
no rounding up); no TorchRec is needed.

Variants, one after another in the order of `_plan` (each freed before the next: one full-size
copy of the tables at a time), all from the same initial weights and batches:
- fbgemm_device: FBGEMM's table-batched embedding (TBE), every row in device memory: what
  TorchRec's `fused` kernel runs, the baseline the ratios are taken against (on a CPU run the
  TBE's CPU kernels, TorchRec's `fused` there);
- fbgemm_uvm (CUDA only): the TBE with its rows in host-mapped pinned memory and an LRU cache of
  each --capacities of them in device memory (`MANAGED_CACHING`): TorchRec's `fused_uvm_caching`;
- fbgemm_uvm_prefetch (CUDA only): the same with `prefetch_pipeline=True`, batch t+1's rows
  prefetched on a side stream after batch t's forward, as under TorchRec's
  `PrefetchTrainPipelineSparseDist` (`_fbgemm_variants.py` has the three and the protocol);
- distcache: `CachedEmbeddingBags` at each --capacities, look-ahead L (--lookahead batches
  enqueued ahead), rows staged K (--prefetch-depth) batches ahead, again while a batch trains;
  its defaults: on CUDA `cuda_graphs` (a batch's routing and scheduling replayed as CUDA
  graphs) and `staging="direct"` (the staging stream copies rows to and from the pinned host
  rows itself; no worker thread);
- distcache_worker (only if named in --variants): distcache with `staging="worker"` (a thread
  waits for each plan and copies its rows over: the default before 2026-11-26);
- distcache_torch (only if named in --variants): distcache with `kernel="torch"` (lookups and
  updates by torch's ops over the slots instead of FBGEMM's TBE);
- distcache_eager (only if named in --variants): distcache with `cuda_graphs=False` (every
  kernel of a batch's routing and scheduling launched one by one: the default before 2026-11-26);
- distcache_fused (only if named in --variants): distcache with `fused=True` (the scheduler's
  fused Triton passes, `distcache.cache.fused`, in place of the torch ops they replace);
- distcache_thread (only if named in --variants): distcache with `scheduler_thread=True` (the
  scheduler's calls on a thread of their own, `distcache.cache.lane`, off the training thread);
- lru: the same engine, reactive (misses loaded at lookup), at each --lru-capacities;
- device: every row in device memory (`nn.EmbeddingBag`, sparse SGD; SGD only), if it fits;
- cpu_embeddings (CUDA only): those bags in host memory, pooled embeddings sent to the device.
A variant that cannot run is skipped with the reason (memory; a cache smaller than the distinct
rows of the batches it pins, K + 1 or 1, measured on the batches before building; no FBGEMM, or
its CPU build on a CUDA run; an optimizer it lacks). One that fails is reported and the others
run.

Rows start from a 4 Mi-float random block tiled over each table, scaled to TorchRec's
uniform(+-1/sqrt(rows)): a seeded `uniform_` runs on one thread, minutes for 12 G floats.

A cached variant trains until its cache is full (distcache: it evicts; FBGEMM's: 99 % of its
slots hold rows; at most --max-warmup steps), so the timed steps are steady-state ones; then
every variant trains --warmup steps, then --steps timed ones (the device synchronized at both
ends). Reported: samples/s; for distcache's caches the hit rate (rows resident / distinct
rows looked up), MB staged per step (loaded + written back), critical-path misses, the time
training waited on staging as a fraction of the step (gpu: the compute stream's stall at the
staging events, CUDA events around `Stager.wait`; host: `CacheStats.wait_s`, lookups staging
on the critical path), and the planning time per batch (host time in the scheduler's enqueue,
stage_next and release: the host launching the scheduler's work, which reads nothing back),
and the stager's submit; for FBGEMM's caches their slots (`cache_rows`). Then --profile-steps
steps run under `torch.profiler`: top ops by self CPU and device time and the `## headline:* ##`
phases go to the JSON. Every variant's host time per timed step in each phase
(`host_ms_per_step`: wall time on the host, a wait for the device included; where the host
is the bottleneck, they sum to the step), and with --cprofile N as many steps again after the
timed ones (which run without it) under cProfile: the N functions of most host time of their
own, after the Python of distcache's own files.
`loss_max_diff`: largest difference of a variant's per-step losses from the first variant's
(same batches, same weights). Throughput ratios: `x_fbgemm_device` (the
table's column when fbgemm_device ran) and `x_device` (nn.EmbeddingBag), `x_cpu_embeddings`.

Usage::

    python benchmarks/gpu_headline.py --device cuda --json $OUT/gpu_headline.json
    python benchmarks/gpu_headline.py --device cuda --optimizer rowwise_adagrad \\
        --variants fbgemm_device,distcache,fbgemm_uvm,fbgemm_uvm_prefetch --capacities 0.01,0.02
    python benchmarks/gpu_headline.py --device cpu --scale 1000 --steps 5  # dry run
    # (add --threads 1 where the cores are shared: idle OpenMP threads spin and drown timings)
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import math
import pstats
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import _fbgemm_variants as fbgemm  # noqa: E402  (imports fbgemm_gpu only when building)
from _common import print_table, write_json  # noqa: E402
from _fbgemm_variants import FBGEMM_CACHED, FBGEMM_VARIANTS  # noqa: E402
from _headline_step import HOST_S, dense_and_backward, phase  # noqa: E402

from distcache import CacheConfig, CachedEmbeddingBags, TableSpec  # noqa: E402
from distcache.cache import transfer  # noqa: E402
from distcache.cache.engine import CacheEngine  # noqa: E402
from distcache.constants import DEFAULT_LOOKAHEAD  # noqa: E402
from distcache.data.traces import zipf_trace  # noqa: E402

# The MLPerf DLRM Terabyte table sizes (also `distcache.data.criteo.CRITEO_TERABYTE_TABLE_SIZES`,
# whose module imports TorchRec; the planner's copy does not).
from distcache.planner.workloads import CRITEO_KAGGLE_ROWS, CRITEO_TERABYTE_ROWS  # noqa: E402

TABLE_ROWS = {"terabyte": CRITEO_TERABYTE_ROWS, "kaggle": CRITEO_KAGGLE_ROWS}

DENSE_FEATURES = 13
BOTTOM = (512, 256)  # bottom MLP hidden widths, then the embedding dim
TOP = (512, 256)  # top MLP hidden widths, then 1 logit
VARIANTS = (
    *FBGEMM_VARIANTS,
    "distcache",
    "lru",
    "device",
    "cpu_embeddings",
    "distcache_worker",
    "distcache_eager",
    "distcache_torch",
    "distcache_fused",
    "distcache_thread",
)
CACHED = (
    "distcache", "distcache_worker", "distcache_eager", "distcache_torch", "distcache_fused",
    "distcache_thread", "lru",
)  # fmt: skip
DEFAULT_VARIANTS = VARIANTS[:7]  # distcache_worker and _eager on request (--variants)
PLAIN_OPTIMIZERS = ("sgd",)  # what `device` and `cpu_embeddings` (torch.optim) train with
_BLOCK = 1 << 22  # floats in the random block tiled over the rows
_GIB = 1 << 30
_DEVICE_SLACK = 4 * _GIB  # bytes/device left for activations, maps and the allocator
_HOST_SLACK = 8 * _GIB  # bytes/host left for the process, batches and staging buffers


def _fractions(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"capacities must lie in (0, 1], got {text!r}")
    return values


def _variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown variants {unknown}: expected {VARIANTS}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--tables", choices=tuple(TABLE_ROWS), default="terabyte")
    ap.add_argument("--scale", type=float, default=1.0, help="table rows = Criteo rows / scale")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument(
        "--batch", type=int, default=0, help="samples per step (default: 4096 / scale, >= 16)"
    )
    ap.add_argument("--alpha", type=float, default=1.05, help="power-law exponent of the ids")
    ap.add_argument("--capacities", type=_fractions, default=[0.02])
    ap.add_argument("--lru-capacities", type=_fractions, default=None, help="default: capacities")
    ap.add_argument(
        "--lookahead", type=int, default=DEFAULT_LOOKAHEAD, help="L: batches enqueued ahead"
    )
    ap.add_argument("--prefetch-depth", type=int, default=1, help="K: batches staged ahead")
    ap.add_argument("--variants", type=_variants, default=list(DEFAULT_VARIANTS))
    ap.add_argument("--lr", type=float, default=0.05, help="embeddings and dense part")
    ap.add_argument(
        "--optimizer",
        choices=("sgd", "rowwise_adagrad"),
        default="sgd",
        help="the embeddings' fused optimizer in every variant (the dense part: SGD)",
    )
    ap.add_argument(
        "--max-warmup", type=int, default=1000, help="most steps a cached variant trains to fill"
    )
    ap.add_argument("--warmup", type=int, default=10, help="steps before timing (once full)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--profile-steps", type=int, default=5, help="0: no profile")
    ap.add_argument(
        "--cprofile",
        type=int,
        default=0,
        help="N > 0: --steps more steps under cProfile, the N functions of most host time",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--staging-programs",
        type=int,
        default=0,
        help="thread blocks of direct staging's Triton copy (0: transfer.STAGING_PROGRAMS)",
    )
    ap.add_argument(
        "--json", default=None, help="default: benchmarks/results/gpu_headline_<device>.json"
    )
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    if (
        not args.scale > 0
        or args.dim < 1
        or args.steps < 1
        or min(args.warmup, args.max_warmup) < 0
    ):
        ap.error("--scale must be > 0, --dim and --steps >= 1, --warmup and --max-warmup >= 0")
    if not 0 <= args.prefetch_depth <= args.lookahead:
        ap.error("expected 0 <= --prefetch-depth <= --lookahead")
    if args.staging_programs < 0:
        ap.error("--staging-programs must be >= 0 (0: distcache's default)")
    args.batch = args.batch or max(16, round(4096 / args.scale))
    args.lru_capacities = args.capacities if args.lru_capacities is None else args.lru_capacities
    args.json = args.json or str(
        Path(__file__).resolve().parent / "results" / f"gpu_headline_{args.device}.json"
    )
    return args


# ---------------------------------------------------------------- data and model


class Data:
    """The batches of the run, on the host and on the device.

    ids: `[n, F, B]` int64 table-local rows, one per feature and sample (bags of one id).
    """

    def __init__(self, rows: Sequence[int], args: argparse.Namespace, n: int, device):
        per_table = [
            zipf_trace(
                rows=r, alpha=args.alpha, batch=args.batch, batches=n, seed=args.seed + t
            ).ids.view(n, args.batch)
            for t, r in enumerate(rows)
        ]
        gen = torch.Generator().manual_seed(args.seed)
        self.ids = torch.stack(per_table, dim=1)  # [n, F, B]
        self.ids_dev = self.ids.to(device)
        self.dense = torch.randn(n, args.batch, DENSE_FEATURES, generator=gen).to(device)
        self.labels = (torch.rand(n, args.batch, generator=gen) < 0.25).float().to(device)
        bags = len(rows) * args.batch
        self.offsets = torch.arange(bags + 1, device=device)  # [F * B + 1]: one id per bag
        self.in_flight: dict[int, int] = {}  # window -> most distinct rows (`in_flight_rows`)

    def values(self, t: int) -> torch.Tensor:
        """Batch t's ids for `CachedEmbeddingBags`: `[F * B]`, feature major."""
        return self.ids_dev[t].view(-1)


def random_block(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(_BLOCK, generator=gen).mul_(2).sub_(1)  # [block] in [-1, 1)


def tiled_uniform_(
    weight: torch.Tensor, rows: int, block: torch.Tensor, *, kernel: bool = False
) -> None:
    """Fill `weight` `[rows, dim]` with `block` scaled to +-1/sqrt(rows), tiled (a copy per
    block: memory-bound, unlike a seeded `uniform_`, which runs on one thread). `kernel`: each
    copy is an elementwise kernel, not a memcpy, for a CUDA tensor in host memory that the
    device maps (FBGEMM's UVM rows), which a device-to-device memcpy need not address."""
    flat = weight.view(-1)
    scaled = (block * math.sqrt(1.0 / rows)).to(weight.device)
    for start in range(0, flat.numel(), scaled.numel()):
        part = flat[start : start + scaled.numel()]
        if kernel:
            torch.mul(scaled[: part.numel()], 1.0, out=part)
        else:
            part.copy_(scaled[: part.numel()])


class TiledCachedBags(CachedEmbeddingBags):
    """`CachedEmbeddingBags` whose rows start from `tiled_uniform_` of the run's block."""

    def _init_weights(self, seed: int) -> None:
        block = random_block(seed)
        for spec in self.tables:
            store, lo, hi = self.table_slab(spec.name)
            tiled_uniform_(store.weights[lo:hi], spec.num_embeddings, block)


class PlainBags(nn.Module):
    """Every row in memory on `device`: one `nn.EmbeddingBag` (sparse gradients) per table."""

    def __init__(self, tables: list[TableSpec], device: torch.device, seed: int):
        super().__init__()
        block = random_block(seed)
        self.bags = nn.ModuleList()
        for t in tables:
            weight = torch.empty(t.num_embeddings, t.embedding_dim, device=device)
            tiled_uniform_(weight, t.num_embeddings, block)
            self.bags.append(
                nn.EmbeddingBag.from_pretrained(weight, freeze=False, mode="sum", sparse=True)
            )
            del weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Pooled `[B, F * dim]` of one id per feature per sample (`ids` `[F, B]`)."""
        return torch.cat([bag(i.unsqueeze(1)) for bag, i in zip(self.bags, ids, strict=True)], 1)


def _mlp(sizes: Sequence[int], final_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if final_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DenseDLRM(nn.Module):
    """DLRM's dense part: bottom MLP, pairwise dot interaction with the pooled embeddings, top
    MLP; `forward(dense [B, 13], pooled [B, F * D]) -> logits [B]`."""

    def __init__(self, num_features: int, dim: int):
        super().__init__()
        self.num_features, self.dim = num_features, dim
        self.bottom = _mlp((DENSE_FEATURES, *BOTTOM, dim), final_relu=True)
        pairs = (num_features + 1) * num_features // 2
        self.top = _mlp((dim + pairs, *TOP, 1), final_relu=False)
        li, lj = torch.tril_indices(num_features + 1, num_features + 1, offset=-1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)  # [B, D]
        z = torch.cat([x.unsqueeze(1), pooled.view(-1, self.num_features, self.dim)], 1)
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.li, self.lj]  # [B, pairs]
        return self.top(torch.cat([x, dots], 1)).squeeze(1)


# ---------------------------------------------------------------- variants


class _Probe:
    """Host time in the scheduler's per-batch methods and in handing plans to the stager (the
    training thread's part of staging), and (CUDA) the compute stream's stall at each lookup's
    staging event, for the engines of one module."""

    def __init__(self, engines: list[CacheEngine], cuda: bool):
        self.cuda = cuda
        self.reset()
        for engine in engines:
            for name in ("enqueue", "stage_next", "release"):
                self._timed(engine.scheduler, name, "plan_s")
            self._timed(engine.stager, "submit", "stage_s")
            if cuda:
                self._evented(engine.stager)

    def reset(self) -> None:
        self.plan_s = self.stage_s = 0.0
        self.waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _timed(self, obj: object, name: str, bucket: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                setattr(self, bucket, getattr(self, bucket) + time.perf_counter() - start)

        setattr(obj, name, timed)

    def _evented(self, stager: object) -> None:
        inner = stager.wait

        def wait(plan):
            before = torch.cuda.Event(enable_timing=True)
            before.record()
            result = inner(plan)
            after = torch.cuda.Event(enable_timing=True)
            after.record()
            self.waits.append((before, after))
            return result

        stager.wait = wait

    def stall_s(self) -> float:
        """Seconds the compute stream waited for staged rows (call after a synchronize)."""
        return sum(b.elapsed_time(a) for b, a in self.waits) / 1e3


class Run:
    """One variant being trained: `step(t)` trains batch t and returns its loss (on device);
    `full()`, where set, says whether a cache other than distcache's (`bags`) is full; `info`
    goes to its results."""

    def __init__(self, name: str, capacity: float | None, step: Callable[[int], torch.Tensor]):
        self.name, self.capacity, self.step = name, capacity, step
        self.bags: CachedEmbeddingBags | None = None
        self.probe: _Probe | None = None
        self.full: Callable[[], bool] | None = None
        self.info: dict = {}


def cached_run(name, capacity, tables, data, dense_model, args, device) -> Run:
    lookahead = name != "lru"
    config = CacheConfig(
        capacity=capacity,
        lookahead=args.lookahead if lookahead else 0,
        prefetch_depth=args.prefetch_depth if lookahead else 0,
        policy="lookahead" if lookahead else "lru",
        optimizer=args.optimizer,
        learning_rate=args.lr,
        staging="worker" if name == "distcache_worker" else None,
        cuda_graphs=False if name == "distcache_eager" else None,
        kernel="torch" if name == "distcache_torch" else None,
        fused=name == "distcache_fused",
        scheduler_thread=name == "distcache_thread",
    )
    bags = TiledCachedBags(tables, config, device=device, seed=args.seed)
    dense_opt = torch.optim.SGD(dense_model.parameters(), lr=args.lr)
    n = data.ids.shape[0]
    enqueued = 0

    def step(t: int) -> torch.Tensor:
        nonlocal enqueued
        if lookahead:
            with phase("enqueue"):
                while enqueued < n and enqueued <= t + config.lookahead:
                    bags.enqueue(data.values(enqueued), data.offsets)
                    enqueued += 1
            with phase("stage"):
                bags.prefetch()
        with phase("forward"):
            pooled = bags(data.values(t), data.offsets)
        if lookahead:
            with phase("stage"):
                bags.prefetch()  # the next batches' rows move while this one trains
        return dense_and_backward(t, pooled, data, dense_model, dense_opt)  # rows update in it

    run = Run(name, capacity, step)
    run.bags = bags
    run.probe = _Probe(bags.engines, device.type == "cuda")
    return run


def plain_run(name, tables, data, dense_model, args, device) -> Run:
    where = torch.device("cpu") if name == "cpu_embeddings" else device
    bags = PlainBags(tables, where, args.seed)
    sparse_opt = torch.optim.SGD(bags.parameters(), lr=args.lr)
    dense_opt = torch.optim.SGD(dense_model.parameters(), lr=args.lr)
    ids = data.ids if where.type == "cpu" else data.ids_dev

    def step(t: int) -> torch.Tensor:
        with phase("forward"):
            pooled = bags(ids[t]).to(device)  # cpu_embeddings: [B, F * D] cross to the device
            loss = F.binary_cross_entropy_with_logits(
                dense_model(data.dense[t], pooled), data.labels[t]
            )
        with phase("backward"):
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            loss.backward()
            sparse_opt.step()
            dense_opt.step()
        return loss.detach()

    return Run(name, None, step)


def fbgemm_run(name, capacity, tables, data, dense_model, args, device) -> Run:
    """FBGEMM's TBE (`_fbgemm_variants`), its rows filled as the other variants' are."""
    block = random_block(args.seed)
    built = fbgemm.build(
        name,
        capacity,
        tables,
        data,
        dense_model,
        CacheConfig(optimizer=args.optimizer, learning_rate=args.lr),  # distcache's eps
        lambda weight, rows: tiled_uniform_(weight, rows, block, kernel=True),
        device,
    )
    run = Run(name, capacity, built.step)
    run.full, run.info = built.full, built.info
    return run


# ---------------------------------------------------------------- measuring


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    """Give freed tables back (device caching allocator, pinned host blocks) before the next."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):  # pinned blocks are cached until emptied
            torch._C._host_emptyCache()


def _host_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def in_flight_rows(data: Data, rows: Sequence[int], window: int) -> int:
    """The most distinct rows that `window` consecutive batches use (all tables, one id space)."""
    if window not in data.in_flight:
        starts = torch.tensor([0, *rows[:-1]], device=data.ids_dev.device).cumsum(0)
        engine_rows = (data.ids_dev + starts.view(1, -1, 1)).view(data.ids.shape[0], -1)
        n = engine_rows.shape[0]  # [n, F * B] rows in one id space
        data.in_flight[window] = max(
            torch.unique(engine_rows[s : s + window]).numel() for s in range(n - window + 1)
        )
    return data.in_flight[window]


def skip_reason(name, capacity, tables, data, args, device) -> str | None:
    """Why a variant cannot run here, or None."""
    table_bytes = sum(t.num_embeddings for t in tables) * args.dim * 4
    host = _host_available()
    cuda = device.type == "cuda"
    if name in ("device", "cpu_embeddings") and args.optimizer not in PLAIN_OPTIMIZERS:
        return (
            f"nn.EmbeddingBag has no fused {args.optimizer} (torch's Adagrad is element-wise): "
            "fbgemm_device is the all-rows-on-the-device baseline"
        )
    if name in FBGEMM_VARIANTS:
        return _fbgemm_skip_reason(name, capacity, tables, table_bytes, host, args, device)
    if name in CACHED:
        rows = [t.num_embeddings for t in tables]
        cache = sum(CacheConfig(capacity=capacity).capacity_rows(r) for r in rows)
        window = args.prefetch_depth + 1 if name != "lru" else 1
        need = in_flight_rows(data, rows, window)
        if cache < need:
            return (
                f"a {capacity:g} cache holds {cache:,} rows but {window} batch(es) in flight use "
                f"{need:,} distinct rows: use a smaller --batch or a larger capacity"
            )
        if host is not None and table_bytes + _HOST_SLACK > host:
            need, free = table_bytes / _GIB, host / _GIB
            return f"the host store needs {need:.1f} GiB, {free:.1f} GiB free"
    elif name == "device" and cuda:
        free, _ = torch.cuda.mem_get_info(device)
        if table_bytes + _DEVICE_SLACK > free:
            return (
                f"the rows need {table_bytes / _GIB:.1f} GiB of device memory, "
                f"{free / _GIB:.1f} GiB free (with {_DEVICE_SLACK / _GIB:g} GiB slack)"
            )
    elif name == "cpu_embeddings":
        if not cuda:
            return "on a CPU run it is the 'device' variant"
        if host is not None and table_bytes + _HOST_SLACK > host:
            need, free = table_bytes / _GIB, host / _GIB
            return f"the rows need {need:.1f} GiB of host memory, {free:.1f} GiB free"
    return None


def _fbgemm_skip_reason(name, capacity, tables, table_bytes, host, args, device) -> str | None:
    """FBGEMM's TBE: installed with CUDA kernels where needed, and room for its rows (device
    memory for fbgemm_device as for `device`; pinned host memory and a cache for the others)."""
    reason = fbgemm.unavailable(name, device, args.optimizer)
    if reason or device.type != "cuda":
        return reason
    free, _ = torch.cuda.mem_get_info(device)
    rows = sum(t.num_embeddings for t in tables)
    # device bytes: the rows (fbgemm_device) or the cache and FBGEMM's 4-byte row map
    need = table_bytes if name not in FBGEMM_CACHED else capacity * table_bytes + 4 * rows
    if args.optimizer == "rowwise_adagrad":
        need += 4 * rows  # the accumulators
    if need + _DEVICE_SLACK > free:
        return (
            f"it needs {need / _GIB:.1f} GiB of device memory, {free / _GIB:.1f} GiB free "
            f"(with {_DEVICE_SLACK / _GIB:g} GiB slack)"
        )
    if name in FBGEMM_CACHED and host is not None and table_bytes + _HOST_SLACK > host:
        need, free = table_bytes / _GIB, host / _GIB
        return f"the host-mapped rows need {need:.1f} GiB, {free:.1f} GiB free"
    return None


def _cache_totals(bags: CachedEmbeddingBags) -> dict[str, float]:
    keys = ("unique", "hits", "loads", "writebacks", "critical_misses", "bytes_loaded")
    stats = [s.as_dict() for s in bags.stats().values()]
    totals = {k: float(sum(s[k] for s in stats)) for k in (*keys, "bytes_written", "wait_s")}
    totals["capacity"] = float(sum(s["capacity"] for s in stats))
    return totals


def _device_time(event) -> float:
    value = getattr(event, "self_device_time_total", None)
    return float(value if value is not None else getattr(event, "self_cuda_time_total", 0.0))


def profile_summary(run: Run, first: int, args, device: torch.device, top: int = 15) -> dict:
    """Top ops by self CPU and self device time over --profile-steps steps, and the phases."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for t in range(first, first + args.profile_steps):
            run.step(t)
        _sync(device)
    rows = [
        {
            "name": e.key,
            "calls": e.count,
            "self_cpu_ms": e.self_cpu_time_total / 1e3 / args.profile_steps,
            "cpu_total_ms": e.cpu_time_total / 1e3 / args.profile_steps,
            "self_device_ms": _device_time(e) / 1e3 / args.profile_steps,
        }
        for e in prof.key_averages()
    ]
    out = {
        "steps": args.profile_steps,
        "per_step": True,
        "phases": [r for r in rows if r["name"].startswith("## headline:")],
        "top_self_cpu": sorted(rows, key=lambda r: -r["self_cpu_ms"])[:top],
    }
    if device.type == "cuda":
        out["top_self_device"] = sorted(rows, key=lambda r: -r["self_device_ms"])[:top]
    return out


def _full(bags: CachedEmbeddingBags) -> bool:
    return all(st.evictions > 0 for st in bags.stats().values())


def _filling(run: Run) -> bool:
    """A cache of the run has room left (distcache's: it has not evicted yet)."""
    if run.full is not None:
        return not run.full()
    return run.bags is not None and not _full(run.bags)


def measure(run: Run, args, device: torch.device) -> dict:
    """Fill the cache (cached variants), warm up, time --steps steps, then profile."""
    losses: list[torch.Tensor] = []
    t = 0
    while t < args.max_warmup and _filling(run):
        losses.append(run.step(t))
        t += 1
    fill_steps = t
    for t in range(fill_steps, fill_steps + args.warmup):
        losses.append(run.step(t))
    first = fill_steps + args.warmup
    _sync(device)
    before = _cache_totals(run.bags) if run.bags is not None else {}
    if run.probe is not None:
        run.probe.reset()
    HOST_S.clear()
    start = time.perf_counter()
    for t in range(first, first + args.steps):
        losses.append(run.step(t))
    host = {name: 1e3 * s / args.steps for name, s in sorted(HOST_S.items())}
    _sync(device)
    wall = time.perf_counter() - start
    after = first + args.steps  # the next step: profiled ones come after the timed
    out: dict = {
        "variant": run.name,
        "capacity": run.capacity,
        "wall_s": wall,
        "samples_per_s": args.steps * args.batch / wall,
        "step_ms": 1e3 * wall / args.steps,
        "fill_steps": fill_steps,
        "losses": torch.stack(losses).cpu().tolist(),  # every step from the first
    }
    out["final_loss"] = sum(out["losses"][-5:]) / 5
    out["host_ms_per_step"] = host  # each phase's host wall time (any wait in it included)
    out.update(run.info)
    if run.full is not None:
        out["cache_full"] = run.full()
    if run.bags is not None:
        out["cache_full"] = _full(run.bags)
        out.update(_cache_metrics(run, before, wall, args.steps))
    if args.cprofile:  # as many steps again under cProfile, once the timed steps' counters
        # and timers were read
        profiler = cProfile.Profile()
        with profiler:
            for t in range(after, after + args.steps):
                run.step(t)
        _sync(device)
        after += args.steps
        out["host_functions"] = host_functions(profiler, args.steps, args.cprofile)
    if args.profile_steps:
        try:
            out["profile"] = profile_summary(run, after, args, device)
        except Exception as err:  # e.g. no CUPTI: keep the measurement
            out["profile"] = {"error": f"{type(err).__name__}: {err}"}
    return out


def _cache_metrics(run: Run, before: dict[str, float], wall: float, steps: int) -> dict:
    """The cache's counters over the timed steps, per step or as fractions of their time."""
    after = _cache_totals(run.bags)
    d = {k: after[k] - before[k] for k in after if k != "capacity"}
    probe = run.probe
    return {
        "cache_rows": after["capacity"],
        "hit_rate": d["hits"] / d["unique"] if d["unique"] else 0.0,
        "loads_per_step": d["loads"] / steps,
        "writebacks_per_step": d["writebacks"] / steps,
        "mb_staged_per_step": (d["bytes_loaded"] + d["bytes_written"]) / 1e6 / steps,
        "critical_misses": int(d["critical_misses"]),
        "wait_host_fraction": d["wait_s"] / wall,
        "wait_gpu_fraction": probe.stall_s() / wall if probe.cuda else None,
        "plan_ms_per_batch": 1e3 * probe.plan_s / steps,
        "plan_fraction": probe.plan_s / wall,
        "stage_host_fraction": probe.stage_s / wall,
    }


# ---------------------------------------------------------------- main


def run_variant(name, capacity, tables, data, args, device: torch.device) -> dict:
    """Build one variant, measure it; its model is freed on return."""
    torch.manual_seed(args.seed)  # every variant starts from the same dense weights
    dense_model = DenseDLRM(len(tables), args.dim).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    if name in CACHED:
        run = cached_run(name, capacity, tables, data, dense_model, args, device)
    elif name in FBGEMM_VARIANTS:
        run = fbgemm_run(name, capacity, tables, data, dense_model, args, device)
    else:
        run = plain_run(name, tables, data, dense_model, args, device)
    build_s = time.perf_counter() - start
    result = {**measure(run, args, device), "build_s": build_s}
    if device.type == "cuda":
        result["device_peak_gib"] = torch.cuda.max_memory_allocated(device) / _GIB
    return result


def _plan(args) -> list[tuple[str, float | None]]:
    """The runs in order of what the issue's targets need first, should the run be cut short
    (results are written after each): the baseline (FBGEMM, all rows on the device), then per
    capacity distcache and FBGEMM's UVM cache without and with prefetching, then distcache
    without CUDA graphs, nn.EmbeddingBag with all rows on the device, LRU, embeddings on the
    CPU, the worker thread's staging."""
    out: list[tuple[str, float | None]] = []
    if "fbgemm_device" in args.variants:
        out.append(("fbgemm_device", None))
    for c in args.capacities:
        for name in ("distcache", *FBGEMM_CACHED):
            if name in args.variants:
                out.append((name, c))
    if "distcache_eager" in args.variants:
        out += [("distcache_eager", c) for c in args.capacities]
    if "distcache_torch" in args.variants:
        out += [("distcache_torch", c) for c in args.capacities]
    if "distcache_fused" in args.variants:
        out += [("distcache_fused", c) for c in args.capacities]
    if "distcache_thread" in args.variants:
        out += [("distcache_thread", c) for c in args.capacities]
    if "device" in args.variants:
        out.append(("device", None))
    if "lru" in args.variants:
        out += [("lru", c) for c in args.lru_capacities]
    if "cpu_embeddings" in args.variants:
        out.append(("cpu_embeddings", None))
    if "distcache_worker" in args.variants:
        out += [("distcache_worker", c) for c in args.capacities]
    return out


def _report(results: list[dict], args, total_rows: int) -> None:
    base = {r["variant"]: r["samples_per_s"] for r in results if "samples_per_s" in r}
    trained = [r for r in results if "losses" in r]
    for r in trained:
        n = min(len(r["losses"]), len(trained[0]["losses"]))
        pairs = zip(r["losses"][:n], trained[0]["losses"][:n], strict=True)
        r["loss_max_diff"] = max((abs(a - b) for a, b in pairs), default=0.0)
    for r in results:
        r["cap"] = "" if r.get("capacity") is None else f"{100 * r['capacity']:g} %"
        for name in ("fbgemm_device", "device", "cpu_embeddings"):
            if "samples_per_s" in r and base.get(name):
                r[f"x_{name}"] = r["samples_per_s"] / base[name]
    # the baseline: FBGEMM with every row on the device where it ran, else nn.EmbeddingBag
    ratio = "fbgemm_device" if base.get("fbgemm_device") else "device"
    print(
        f"\nCriteo {args.tables} tables / {args.scale:g}: {total_rows:,} rows x {args.dim} "
        f"({total_rows * args.dim * 4 / 1e9:.2f} GB fp32), batch {args.batch}, {args.device}, "
        f"L={args.lookahead} K={args.prefetch_depth}, {args.steps} steps after {args.warmup}"
    )
    print_table(
        results,
        [
            ("variant", "variant"),
            ("cap", "capacity"),
            ("samples_per_s", "samples/s"),
            (f"x_{ratio}", f"x {ratio}"),
            ("x_cpu_embeddings", "x cpu emb"),
            ("hit_rate", "hit rate"),
            ("mb_staged_per_step", "MB staged/step"),
            ("critical_misses", "critical misses"),
            ("wait_gpu_fraction", "wait gpu"),
            ("wait_host_fraction", "wait host"),
            ("plan_ms_per_batch", "plan ms/batch"),
            ("plan_fraction", "plan"),
            ("final_loss", "loss (last 5)"),
            ("loss_max_diff", "loss diff"),
            ("fill_steps", "fill steps"),
            ("skipped", "skipped"),
        ],
    )


def host_functions(profiler: cProfile.Profile, steps: int, top: int) -> list[dict]:
    """The `top` functions of most host time of their own (cProfile's tottime) per step, and
    as the first row the Python of distcache's own files (the rest: torch's ops, the
    benchmark, the interpreter)."""
    rows, ours = [], 0.0
    for (path, line, fn), (_, calls, own, total, _) in pstats.Stats(profiler).stats.items():
        where = f"{path.split('site-packages/')[-1].removeprefix(str(ROOT) + '/')}:{line}({fn})"
        ours += own if where.startswith("distcache/") else 0.0
        rows.append({"function": where, "own_ms": 1e3 * own / steps,
                     "total_ms": 1e3 * total / steps, "calls": calls / steps})  # fmt: skip
    rows.sort(key=lambda r: -r["own_ms"])
    return [{"function": "(distcache/*.py, own time)", "own_ms": 1e3 * ours / steps}, *rows[:top]]


def _print_profile(result: dict) -> None:
    profile = result.get("profile")
    if not profile or "error" in profile:
        return
    key = "top_self_device" if "top_self_device" in profile else "top_self_cpu"
    unit = "self_device_ms" if key == "top_self_device" else "self_cpu_ms"
    print(f"  {result['variant']} {result.get('cap', '')}: top ops by {unit} per step")
    for r in profile[key][:8]:
        print(f"    {r[unit]:9.3f}  {r['name'][:90]}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.staging_programs:  # (read by every copy: issue 33, item 4)
        transfer.STAGING_PROGRAMS = args.staging_programs
    device = torch.device(args.device)
    rows = tuple(max(3, round(r / args.scale)) for r in TABLE_ROWS[args.tables])
    tables = [
        TableSpec(name=f"t{i}", num_embeddings=r, embedding_dim=args.dim)
        for i, r in enumerate(rows)
    ]
    steps = args.max_warmup + args.warmup + args.steps * (2 if args.cprofile else 1)
    steps += args.profile_steps
    data = Data(rows, args, steps + args.lookahead + 1, device)
    config = {**vars(args), "rows": list(rows), "total_rows": sum(rows)}
    if any(name in FBGEMM_VARIANTS for name in args.variants):
        config["fbgemm_gpu"] = fbgemm.describe()
    if device.type == "cuda":
        config["gpu"] = torch.cuda.get_device_name(device)
    results: list[dict] = []
    failed = False
    for name, capacity in _plan(args):
        label = name if capacity is None else f"{name} {100 * capacity:g} %"
        reason = skip_reason(name, capacity, tables, data, args, device)
        if reason:
            print(f"{label}: skipped: {reason}", flush=True)
            results.append({"variant": name, "capacity": capacity, "skipped": reason})
            continue
        try:
            result = run_variant(name, capacity, tables, data, args, device)
        except Exception as err:  # one variant failing (e.g. out of memory) keeps the others
            print(f"{label}: FAILED\n{traceback.format_exc()}", flush=True)
            result = {"variant": name, "capacity": capacity, "error": traceback.format_exc()}
            result["skipped"] = f"failed: {type(err).__name__}: {str(err)[:200]}"
            failed = True
        _release(device)
        if result.get("critical_misses") and name != "lru":
            failed = True
        if "samples_per_s" in result:
            print(
                f"{label}: {result['samples_per_s']:,.0f} samples/s, "
                f"{result['step_ms']:.1f} ms/step, built in {result['build_s']:.1f} s; host ms "
                + ", ".join(f"{k} {v:.2f}" for k, v in result["host_ms_per_step"].items()),
                flush=True,
            )
            for f in result.get("host_functions", [])[:20]:
                print(f"    {f['own_ms']:7.3f} ms/step  {f['function'][:100]}")
        results.append(result)
        write_json(args.json, config, results)  # after each variant: a timeout keeps the rest
    _report(results, args, sum(rows))
    for r in results:
        _print_profile(r)
    write_json(args.json, config, results)
    print(f"results: {args.json}")
    if failed:
        print("FAIL: a variant failed, or distcache had critical-path misses")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
