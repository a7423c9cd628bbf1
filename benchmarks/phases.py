"""Where a training step's time goes, per phase: wall time and the training thread's CPU time.

`throughput.py --phases` times these methods inside every timed step of each variant, on every
rank: the model's forward and backward, the dense optimizer, TorchRec's input and output
distribution, TorchRec's pipeline's stages, distcache's pipeline's stages (route start, advance
and finish: the look-ahead window's input all-to-all and the scheduler's entry), its staging,
its engine's calls and the id check. Each figure is inclusive (a phase holds the phases it
calls) and counted per timed step. CPU time is `time.thread_time` of the training thread: a
collective's wait blocks without spinning, so CPU time is work and wall less CPU is waiting
(for the other ranks, or for a core: on a machine with as many cores as ranks, another
process's work or a communication thread takes the core).

Each wrapped call costs a few microseconds (two clock reads); on CUDA the phases time the
host's work, the kernels running after it.

Why it exists: the ratio of two variants says how far apart they are, not where. Measured on
2 shared cores (2026-11-28, `benchmarks/results/throughput_phases_cpu_*.json`), distcache at
100 % ran level with TorchRec on one rank (0.996 x) and at 0.92 x on two, where its training
thread spent 1.4 ms more CPU a step: the phases say in which stages.

Example::

    python benchmarks/throughput.py --ranks 2 --threads 1 --capacities 1.0 \\
        --lru-capacities "" --phases
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import time
from collections.abc import Iterator

#: Phase name -> "module:Class.method" (a method of a class, or "module:function").
PHASES: dict[str, str] = {
    "step": "",  # the variant's whole step (timed by `PhaseTimers.step`)
    "forward": "torchrec.models.dlrm:DLRM.forward",
    "backward": "torch:Tensor.backward",
    "dense optimizer": "torch.optim.sgd:SGD.step",
    "input_dist": "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection.input_dist",
    "compute_and_output_dist": (
        "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection.compute_and_output_dist"
    ),
    "torchrec: start_sparse_data_dist": (
        "torchrec.distributed.train_pipeline.train_pipelines:"
        "TrainPipelineSparseDist.start_sparse_data_dist"
    ),
    "torchrec: wait_sparse_data_dist": (
        "torchrec.distributed.train_pipeline.train_pipelines:"
        "TrainPipelineSparseDist.wait_sparse_data_dist"
    ),
    "distcache: route start": "distcache.pipeline.lookahead:LookaheadTrainPipeline._start_route",
    "distcache: route advance": (
        "distcache.pipeline.lookahead:LookaheadTrainPipeline._advance_route"
    ),
    "distcache: route finish": "distcache.pipeline.lookahead:LookaheadTrainPipeline._finish_route",
    "distcache: id check": "distcache.sharding.sharded_module:CachedShardedModule._check_batch",
    "distcache: stage ahead": "distcache.sharding.sharded_module:CachedShardedModule.stage_ahead",
    "engine: enqueue": "distcache.cache.module:CachedEmbeddingBags.enqueue",
    "engine: stage": "distcache.cache.module:CachedEmbeddingBags.prefetch",
    "engine: lookup": "distcache.cache.module:CachedEmbeddingBags.forward",
    "engine: update": "distcache.cache.engine:CacheEngine.apply_gradients",
    "engine: release": "distcache.cache.engine:CacheEngine.release",
}


class PhaseTimers:
    """Accumulates each phase's wall and CPU seconds while a variant's step runs (`step`)."""

    def __init__(self, phases: dict[str, str] | None = None):
        self.phases = dict(PHASES if phases is None else phases)
        self._variant: int | None = None
        self._active: set[str] = set()  # phases running now (a recursive call is not re-counted)
        self.totals: dict[int, dict[str, list[float]]] = {}  # variant -> phase -> [wall, cpu, n]
        self.steps: dict[int, int] = {}
        self._undo: list[tuple[object, str, object]] = []

    def install(self) -> None:
        """Wrap every phase's method (those whose module or class is missing are skipped)."""
        for name, target in self.phases.items():
            if not target:
                continue
            module, _, path = target.partition(":")
            *owner_path, attr = path.split(".")
            try:
                owner = importlib.import_module(module)
                for part in owner_path:
                    owner = getattr(owner, part)
                original = getattr(owner, attr)
            except (ImportError, AttributeError):
                continue
            own = vars(owner).get(attr)  # None where the class inherits it
            self._undo.append((owner, attr, own))
            setattr(owner, attr, self._wrap(name, original))

    def uninstall(self) -> None:
        """Put every wrapped method back as it was (an inherited one inherited again)."""
        for owner, attr, own in reversed(self._undo):
            if own is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, own)
        self._undo.clear()

    def _wrap(self, name: str, fn):  # noqa: ANN001, ANN202
        @functools.wraps(fn)
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if self._variant is None or name in self._active:
                return fn(*args, **kwargs)
            with self._timing(name):
                return fn(*args, **kwargs)

        return timed

    @contextlib.contextmanager
    def _timing(self, name: str) -> Iterator[None]:
        self._active.add(name)
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self._active.discard(name)
            total = self.totals.setdefault(self._variant, {}).setdefault(name, [0.0, 0.0, 0])
            total[0] += time.perf_counter() - wall
            total[1] += time.thread_time() - cpu
            total[2] += 1

    @contextlib.contextmanager
    def step(self, variant: int) -> Iterator[None]:
        """Time one step of variant `variant` (its phases and the whole, as "step")."""
        self._variant = variant
        try:
            with self._timing("step"):
                yield
        finally:
            self._variant = None
            self.steps[variant] = self.steps.get(variant, 0) + 1

    def per_step(self, variant: int) -> dict[str, dict[str, float]]:
        """Phase -> wall_ms, cpu_ms and calls per timed step of `variant`, in `PHASES` order."""
        steps = self.steps.get(variant, 0)
        found = self.totals.get(variant, {})
        return {
            name: {
                "wall_ms": 1e3 * found[name][0] / steps,
                "cpu_ms": 1e3 * found[name][1] / steps,
                "calls": found[name][2] / steps,
            }
            for name in self.phases
            if name in found and steps
        }


def report(per_rank: list[list[dict]]) -> list[str]:
    """Lines of a table: per phase, each variant's CPU ms a step (wall in parentheses), the
    mean over ranks."""
    variants = per_rank[0]
    names = [
        v["variant"] + ("" if v["capacity"] is None else f" {v['capacity']:g}") for v in variants
    ]
    phases: list[str] = []
    for v in variants:
        phases += [p for p in v.get("phases", {}) if p not in phases]
    if not phases:
        return []
    width = max(len(p) for p in phases)
    lines = [
        "per phase, ms a step: the training thread's CPU (wall), mean of the ranks; inclusive",
        " " * width + "".join(f"  {n:>18}" for n in names),
    ]
    for phase in phases:
        cells = []
        for i in range(len(variants)):
            found = [r[i].get("phases", {}).get(phase) for r in per_rank]
            if any(f is None for f in found):
                cells.append(f"  {'':>18}")
                continue
            cpu = sum(f["cpu_ms"] for f in found) / len(found)
            wall = sum(f["wall_ms"] for f in found) / len(found)
            cells.append(f"  {f'{cpu:.2f} ({wall:.2f})':>18}")
        lines.append(f"{phase:<{width}}" + "".join(cells))
    return lines
