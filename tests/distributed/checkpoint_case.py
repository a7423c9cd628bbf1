"""Save a trained, cached, sharded model with torch.distributed.checkpoint; load it elsewhere."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed.checkpoint as dcp
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from distcache import CacheConfig
from distcache.sharding import CACHED_KERNEL
from tests.distributed.ec_case import local_seq_slice, make_ec, seq_batches, seq_loss, shard_ec
from tests.distributed.sharded_model import global_batches, local_slice, loss_of, make_ebc, shard

Shards = dict[str, list[tuple[list[int], torch.Tensor]]]
# Two choices of hot rows (`CacheConfig.hot_rows`) per table: a checkpoint saved with one loads
# with the other, or with none. The second reduces its gradients as touched rows.
HOT = {
    "a": {"t0": (0, 1, 2, 3), "t1": (0, 1, 2), "t3": (0, 1)},
    "b": {"t0": (5, 6), "t1": (0,), "t2": (0, 1, 2)},
}
HOT_EC = {"a": {"s0": (0, 1, 2), "s2": (0, 1)}, "b": {"s1": (0, 1), "s2": (3,)}}


def _model(
    kind: str,
    seed: int,
    optimizer: str = "rowwise_adagrad",
    data_type: str = "FP32",
    weighted: bool = False,
    module: str = "ebc",
    hot: str | None = None,
    kernel: str = CACHED_KERNEL,
):
    torch.manual_seed(seed)
    opt_cls = {"rowwise_adagrad": RowWiseAdagrad, "adagrad": torch.optim.Adagrad}[optimizer]
    config = CacheConfig(capacity=14, lookahead=2, prefetch_depth=1)
    if module == "ec":
        ec = make_ec(data_type=data_type)
        apply_optimizer_in_backward(opt_cls, ec.embeddings.parameters(), {"lr": 0.1, "eps": 1e-6})
        config = dataclasses.replace(config, capacity=20)
        big = {"s2": CacheConfig(capacity=40)}  # two features of sequences: a larger cache
        for table, rows in HOT_EC.get(hot or "", {}).items():
            big[table] = dataclasses.replace(big.get(table, config), hot_rows=rows)
        return shard_ec(ec, "", ec, kind, config, big)
    ebc = make_ebc(data_type=data_type, weighted=weighted)
    apply_optimizer_in_backward(opt_cls, ebc.embedding_bags.parameters(), {"lr": 0.1, "eps": 1e-6})
    # t3 serves two features: a larger cache of its own.
    tables = {"t3": CacheConfig(capacity=28)}
    reduce = "touched" if hot == "b" else "all"
    for table, rows in HOT.get(hot or "", {}).items():
        tables[table] = dataclasses.replace(
            tables.get(table, config), hot_rows=rows, hot_reduce=reduce
        )
    return shard(ebc, kind, config, tables, kernel)


def _batches(module: str, num: int, world: int, seed: int, weighted: bool) -> list:
    if module == "ec":
        return seq_batches(num, 3, world, seed)
    return global_batches(num, 3, world, seed=seed, weighted=weighted)


def _train_step(model, module: str, batch, rank: int, world: int) -> None:
    if module == "ec":
        seq_loss(model(local_seq_slice(batch, rank, world))).backward()
    else:
        loss_of(model(local_slice(batch, rank, world))).backward()


def _state(model) -> dict:
    return {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}


def _local_shards(state: dict) -> Shards:
    out: Shards = {}

    def visit(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit(f"{prefix}/{k}", v)
        elif hasattr(value, "local_shards"):
            out[prefix] = [
                (list(s.metadata.shard_offsets), s.tensor.clone()) for s in value.local_shards()
            ]

    visit("", state)
    return out


def save(
    rank: int,
    world: int,
    path: str,
    kind: str = "table_wise",
    steps: int = 6,
    optimizer: str = "rowwise_adagrad",
    data_type: str = "FP32",
    weighted: bool = False,
    module: str = "ebc",
    hot: str | None = None,
    kernel: str = CACHED_KERNEL,
) -> Shards:
    model = _model(kind, 0, optimizer, data_type, weighted, module, hot, kernel)
    for batch in _batches(module, steps, world, 5, weighted):
        _train_step(model, module, batch, rank, world)
    dirty = sum(
        int(e.scheduler.residency.dirty.sum())
        for m in model.modules()
        if hasattr(m, "cached_kernels")
        for k in m.cached_kernels()
        for e in k.bags.engines
    )
    # (on TorchRec's kernel, hot rows are the only rows held apart from the tables)
    assert dirty > 0 or kernel != CACHED_KERNEL, (
        "the checkpoint must be taken with updates held only in caches"
    )
    state = _state(model)  # flushes first
    dcp.save(state, checkpoint_id=path)
    return _local_shards(state)


def load(
    rank: int,
    world: int,
    path: str,
    kind: str,
    optimizer: str = "rowwise_adagrad",
    data_type: str = "FP32",
    weighted: bool = False,
    module: str = "ebc",
    hot: str | None = None,
    kernel: str = CACHED_KERNEL,
) -> Shards:
    # Different initial rows: everything must come from the checkpoint.
    model = _model(kind, 123, optimizer, data_type, weighted, module, hot, kernel)
    state = _state(model)
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    model.fused_optimizer.load_state_dict(state["optim"])
    # Read back through a forward pass too: no stale cached row may be served.
    batch = _batches(module, 1, world, 9, weighted)[0]
    model(
        local_seq_slice(batch, rank, world) if module == "ec" else local_slice(batch, rank, world)
    )
    return _local_shards(_state(model))


def assemble(per_rank: list[Shards]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's local shards."""
    full: dict[str, torch.Tensor] = {}
    for shards in per_rank:
        for key, parts in shards.items():
            for offsets, tensor in parts:
                tensor = tensor.view(tensor.shape[0], -1)  # a row-wise state may be 1-D
                offsets = [*offsets, 0][:2]
                rows, cols = offsets[0] + tensor.shape[0], offsets[1] + tensor.shape[1]
                if key not in full:
                    full[key] = torch.full((1, 1), float("nan"))
                grown = full[key]
                if grown.shape[0] < rows or grown.shape[1] < cols:
                    bigger = torch.full(
                        (max(rows, grown.shape[0]), max(cols, grown.shape[1])), float("nan")
                    )
                    bigger[: grown.shape[0], : grown.shape[1]] = grown
                    full[key] = grown = bigger
                grown[offsets[0] : rows, offsets[1] : cols] = tensor
    return full


def _name(key: str) -> str:
    """The tensor's last path element: `embedding_bags.t0.weight` or `t0.momentum1`."""
    return key.split("/")[-1]


def assert_same(saved: list[Shards], loaded: list[Shards], tables: int = 4) -> None:
    a = {_name(k): v for k, v in assemble(saved).items()}
    b = {_name(k): v for k, v in assemble(loaded).items()}
    assert set(a) == set(b) and len(a) == 2 * tables, (sorted(a), sorted(b))  # rows, state
    assert sum("momentum" in k for k in a) == tables, sorted(a)  # every table's optimizer state
    for key in a:
        assert not a[key].isnan().any(), f"{key}: saved shards do not cover the table"
        assert torch.equal(a[key], b[key]), key
