"""Can a cache's scheduling leave the training thread, and where to? (issue 33)

On a GPU the host sets a step's pace (benchmarks/results/h200_2026-11-28): distcache's
scheduling calls took 1.4-1.9 ms of the training thread's 6.3 ms step, while FBGEMM's whole step
took 3.3 ms. Two places could take that host work off the training thread:
- a thread of its own (`CacheConfig.scheduler_thread`): it shares the GIL, which torch
  releases while it dispatches each op, so the threads hand it over at every op (on CPU the
  engine's thread ran at 0.51-0.53 x inline);
- a process of its own: no GIL shared, but a CUDA context of its own, which the GPU
  time-slices with the trainer's (without MPS), and every plan would have to cross to the
  trainer through shared memory.

This measures both before either carries the engine's plans: a host-bound training step
(`gpu_headline.py`'s `device` variant: its DLRM dense part over an `nn.EmbeddingBag` per table
with sparse SGD, every row on the device) runs
- `alone`;
- `inline`: with distcache's per-batch work other than the lookup and update on the same
  thread, as it runs by default: `gpu_headline.py`'s distcache variant at --capacity of
  Criteo's tables / --scale (a batch routed and entering the window L ahead, staging K = 1
  ahead, the oldest batch's plan taken and released; the device's defaults: CUDA graphs and
  direct staging on a GPU);
- `thread`: that work on a thread of its own, at most --lag steps behind the training step;
- `process`: that work in a process of its own (spawned; its own engine and batches, the same
  sizes), at most --lag steps behind;
- `process_cpu`: the same with the side's cache on the CPU (the scheduler's C kernels, rows
  copied in host memory): whether a CPU process could plan a GPU's batches as fast as it
  trains them, without a second CUDA context (cDLRM's look-ahead pre-processor, in spirit).
The side work's plans are not used by the training step: what is measured is what running
it costs the step where it runs. The modes take turns for --rounds rounds of --steps steps
each; reported are each mode's steps/s (median and range over rounds), its ratio to
`alone`'s median, and the host time of a side step where it ran.

Usage::

    python benchmarks/host_overlap.py --device cuda --json $OUT/host_overlap.json
    python benchmarks/host_overlap.py --device cpu --scale 1000 --batch 256 --steps 30 \\
        --rounds 2 --threads 1     # a smoke run
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table, write_json  # noqa: E402
from gpu_headline import TABLE_ROWS, Data, DenseDLRM, plain_run  # noqa: E402

from distcache import CacheConfig, CachedEmbeddingBags, TableSpec  # noqa: E402

MODES = ("alone", "inline", "thread", "process", "process_cpu")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--tables", choices=tuple(TABLE_ROWS), default="terabyte")
    ap.add_argument("--scale", type=float, default=100, help="table rows = Criteo rows / scale")
    ap.add_argument("--capacity", type=float, default=0.02, help="the side's cache, a fraction")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4096, help="samples per step (one id a table)")
    ap.add_argument("--alpha", type=float, default=1.05, help="power-law exponent of the ids")
    ap.add_argument("--lookahead", type=int, default=64)
    ap.add_argument("--lag", type=int, default=1, help="steps the side work may fall behind")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--steps", type=int, default=200, help="timed steps per mode and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES), help=f"some of {MODES}")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--side-threads", type=int, default=1, help="torch threads of a side process")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown or "alone" not in args.modes:
        ap.error(f"--modes {unknown or args.modes}: expected 'alone' and others of {MODES}")
    if min(args.batch, args.steps, args.rounds, args.dim) < 1 or not args.scale > 0:
        ap.error("--batch, --dim, --steps and --rounds must be >= 1, --scale > 0")
    if min(args.lag, args.side_threads) < 1 or not 0 < args.capacity <= 1:
        ap.error("expected --lag and --side-threads >= 1 and 0 < --capacity <= 1")
    args.json = args.json or str(
        Path(__file__).resolve().parent / "results" / f"host_overlap_{args.device}.json"
    )
    return args


def _rows(args: argparse.Namespace) -> list[int]:
    return [max(3, round(r / args.scale)) for r in TABLE_ROWS[args.tables]]


class Side:
    """distcache's per-batch work outside the lookup and update, on batches of its own, as
    `gpu_headline.py`'s distcache variant drives `CachedEmbeddingBags` (one cache for its
    tables, the device's defaults): each `step` enqueues the batch L ahead (its routing and
    entry into the window), stages, looks up the oldest batch without gradients (its plan
    taken and released) and stages the next."""

    BATCHES = 64  # cycled

    def __init__(self, args: argparse.Namespace, seed: int = 1):
        device = torch.device(args.device)
        rows = _rows(args)
        config = CacheConfig(capacity=args.capacity, lookahead=args.lookahead, prefetch_depth=1)
        tables = [
            TableSpec(name=f"t{i}", num_embeddings=r, embedding_dim=args.dim)
            for i, r in enumerate(rows)
        ]
        self.bags = CachedEmbeddingBags(tables, config, device=device, seed=seed)
        self.data = Data(
            rows, argparse.Namespace(**{**vars(args), "seed": seed}), self.BATCHES, device
        )
        self.lookahead, self.t, self.enqueued = args.lookahead, 0, 0
        self.busy_s = 0.0  # host seconds in `step`

    def step(self) -> None:
        start = time.perf_counter()
        bags, data, n = self.bags, self.data, self.BATCHES
        while self.enqueued <= self.t + self.lookahead:
            bags.enqueue(data.values(self.enqueued % n), data.offsets)
            self.enqueued += 1
        bags.prefetch()
        with torch.no_grad():
            bags(data.values(self.t % n), data.offsets)
        bags.prefetch()  # the next batch's rows move while this step trains
        self.t += 1
        self.busy_s += time.perf_counter() - start


class Trainer:
    """The training step: `gpu_headline.py`'s `device` variant (`plain_run`: an `nn.EmbeddingBag`
    per table with sparse SGD, every row on the device, the DLRM dense part, its backward and
    SGD), the step whose figures the H200 has, on batches of its own."""

    BATCHES = 16  # cycled

    def __init__(self, args: argparse.Namespace):
        device = torch.device(args.device)
        rows = _rows(args)
        tables = [
            TableSpec(name=f"t{i}", num_embeddings=r, embedding_dim=args.dim)
            for i, r in enumerate(rows)
        ]
        settings = argparse.Namespace(**{**vars(args), "seed": 0, "lr": 0.01})
        data = Data(rows, settings, self.BATCHES, device)
        dense_model = DenseDLRM(len(rows), args.dim).to(device)
        self.run = plain_run("device", tables, data, dense_model, settings, device)
        self.t = 0

    def step(self) -> None:
        self.run.step(self.t % self.BATCHES)
        self.t += 1


def _side_process(args, device, go, done, busy, stop, ready) -> None:  # noqa: ANN001
    """A side process's loop: its own `Side` on `device`, one step for each release of `go`
    (blocked, not spinning, while it has none: the other modes' steps share the cores)."""
    torch.set_num_threads(args.side_threads)
    side = Side(argparse.Namespace(**{**vars(args), "device": device}))
    for _ in range(args.lookahead + 2):
        side.step()
    busy.value, done.value = side.busy_s, side.t
    ready.set()
    while not stop.is_set():
        if go.acquire(timeout=0.05):
            side.step()
            busy.value, done.value = side.busy_s, side.t


class SideProcess:
    """A spawned process running a `Side` on `device`, which the trainer asks for steps (a
    semaphore) and waits for (a counter in shared memory); nothing on a device is shared."""

    def __init__(self, args: argparse.Namespace, device: str):
        ctx = mp.get_context("spawn")  # (a forked child cannot use CUDA)
        self.go, self.done = ctx.Semaphore(0), ctx.Value("q", 0, lock=False)
        self.busy = ctx.Value("d", 0.0, lock=False)  # its side's `busy_s`
        self.stop, self._ready = ctx.Event(), ctx.Event()
        self.process = ctx.Process(
            target=_side_process,
            args=(args, device, self.go, self.done, self.busy, self.stop, self._ready),
            daemon=True,
        )
        self.process.start()
        self.base = self.requested = 0

    def ready(self) -> None:
        """Wait until its side has warmed up (the window full, its graphs captured)."""
        while not self._ready.wait(timeout=1):
            self._check_alive()
        self.base = self.requested = self.done.value

    def steps(self) -> int:
        """Steps done since it was ready."""
        return self.done.value - self.base

    def run(self, trainer: Trainer, steps: int, lag: int) -> None:
        """`steps` training steps, each at most `lag` steps ahead of the side's."""
        first = self.requested
        for i in range(1, steps + 1):
            self.go.release()
            self.requested = first + i
            self._wait(first + i - lag)
            trainer.step()
        self._wait(first + steps)

    def _wait(self, step: int) -> None:
        while self.done.value < step:
            self._check_alive()
            time.sleep(0)

    def _check_alive(self) -> None:
        if not self.process.is_alive():
            raise RuntimeError(f"a side process died (exit code {self.process.exitcode})")

    def close(self) -> None:
        self.stop.set()
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()


class Modes:
    """Each mode's `run(steps)`: the trainer's steps with the side work as the mode runs it."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.device = torch.device(args.device)
        # First: they build their sides while this process builds its own.
        self.processes = {
            mode: SideProcess(args, args.device if mode == "process" else "cpu")
            for mode in ("process", "process_cpu")
            if mode in args.modes
        }
        self.trainer = Trainer(args)
        self.side = Side(args) if {"inline", "thread"} & set(args.modes) else None
        self.executor = ThreadPoolExecutor(1) if "thread" in args.modes else None
        for process in self.processes.values():
            process.ready()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def side_totals(self) -> tuple[int, float]:
        """Steps the side work has done so far, in this process and in the side processes,
        and the host seconds they took where they ran."""
        here = (0, 0.0) if self.side is None else (self.side.t, self.side.busy_s)
        there = [(p.steps(), p.busy.value) for p in self.processes.values()]
        return here[0] + sum(n for n, _ in there), here[1] + sum(b for _, b in there)

    def run(self, mode: str, steps: int) -> float:
        """Steps/s of `steps` steps of `mode` (the device synchronized at both ends)."""
        trainer, side, lag = self.trainer, self.side, self.args.lag
        self.sync()
        start = time.perf_counter()
        if mode == "alone":
            for _ in range(steps):
                trainer.step()
        elif mode == "inline":
            for _ in range(steps):
                side.step()
                trainer.step()
        elif mode == "thread":
            pending: list[Future] = []
            for _ in range(steps):
                pending.append(self.executor.submit(side.step))
                while len(pending) > lag:
                    pending.pop(0).result()
                trainer.step()
            for f in pending:
                f.result()
        else:
            self.processes[mode].run(trainer, steps, lag)
        self.sync()
        return steps / (time.perf_counter() - start)

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()
        for process in self.processes.values():
            process.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = Modes(args)
    try:
        for mode in args.modes:
            modes.run(mode, args.warmup)
        rates: dict[str, list[float]] = {m: [] for m in args.modes}
        side = {m: [0, 0.0] for m in args.modes}  # the side work's steps and host s, timed
        for r in range(args.rounds):
            order = args.modes[r % len(args.modes) :] + args.modes[: r % len(args.modes)]
            for mode in order:
                steps, busy = modes.side_totals()
                rates[mode].append(modes.run(mode, args.steps))
                now = modes.side_totals()
                side[mode][0] += now[0] - steps
                side[mode][1] += now[1] - busy
    finally:
        modes.close()
    alone = statistics.median(rates["alone"])
    results = [
        {
            "mode": m,
            "steps_per_s": statistics.median(r),
            "low": min(r),
            "high": max(r),
            "x_alone": statistics.median(r) / alone,
            "rounds": r,
            "side_steps": side[m][0],
            # a side step's host time where it ran (its device work is queued, not waited for)
            "side_host_ms": 1e3 * side[m][1] / side[m][0] if side[m][0] else None,
        }
        for m, r in rates.items()
    ]
    config = {k: v for k, v in vars(args).items() if k != "json"}
    if args.device == "cuda":
        config["gpu"] = torch.cuda.get_device_name()
    print(f"a training step with a cache's scheduling beside it, on {args.device}, "
          f"median [range] over {args.rounds} rounds:")  # fmt: skip
    print_table(
        results,
        [("mode", "mode"), ("steps_per_s", "steps/s"), ("low", "low"), ("high", "high"),
         ("x_alone", "x alone"), ("side_host_ms", "side host ms")],
    )  # fmt: skip
    write_json(args.json, config, results)
    print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
