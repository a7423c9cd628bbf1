"""One sweep case: uncached TorchRec vs the kernel's synchronous path vs the look-ahead pipeline
vs TorchRec's `PrefetchTrainPipelineSparseDist` over the kernel (its streams emulated on CPU).

The four train the same EmbeddingBagCollection (integer weights, SGD with lr 1, so fp32 is
exact) on the same batches, which vary in size and include a batch with no ids at all; they
must agree bitwise, step by step and at the end, and the pipelines must never miss.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torchrec import KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from distcache import CacheConfig, DistcacheConfigError, InvalidIdError, LookaheadWindowError
from distcache.pipeline import LookaheadTrainPipeline
from distcache.sharding import CachedEmbeddingBagCollectionSharder, cache_stats
from tests.distributed.prefetch_pipeline import CpuPrefetchPipeline, idle_optimizer
from tests.distributed.sharded_model import (
    FEATURES,
    TABLES,
    compare_with_global,
    copy_global_into,
    integer_init,
    local_shards,
    local_slice,
    loss_of,
    make_ebc,
    per_table_plan,
    plan_for,
)


class EbcTrain(nn.Module):
    """`(loss, output)` from a batch, like TorchRec's DLRMTrain, around a bare EBC."""

    def __init__(self, ebc: nn.Module):
        super().__init__()
        self.ebc = ebc

    def forward(self, batch: Batch):  # noqa: ANN201
        out = self.ebc(batch.sparse_features)
        return loss_of(out), out


def sweep_batches(
    steps: int, world: int, seed: int, weighted: bool = False
) -> list[KeyedJaggedTensor]:
    """Global batches of 1..3 samples per rank, 0..2 ids per bag; batch 2 has no ids at all.
    `weighted`: an integer weight in [1, 3] per id."""
    gen = torch.Generator().manual_seed(seed)
    weight_gen = torch.Generator().manual_seed(seed + 1)
    rows = {f: r for _, r, _, fs in TABLES for f in fs}
    out = []
    for step in range(steps):
        b = world * int(torch.randint(1, 4, (1,), generator=gen))
        lengths = torch.randint(0, 3, (len(FEATURES) * b,), generator=gen)
        if step == 2:
            lengths.zero_()
        values = []
        for k, f in enumerate(FEATURES):
            n = int(lengths[k * b : (k + 1) * b].sum())
            u = torch.rand(n, generator=gen)
            values.append(((rows[f] ** u).long() - 1).clamp(0, rows[f] - 1))
        ids = torch.cat(values)
        weights = torch.randint(1, 4, ids.shape, generator=weight_gen).float() if weighted else None
        out.append(KeyedJaggedTensor.from_lengths_sync(FEATURES, ids, lengths, weights=weights))
    return out


def in_flight_rows(batches: list[KeyedJaggedTensor], depth: int) -> int:
    """The most distinct rows of one table that depth + 1 consecutive batches touch: a cache of
    that many rows per table holds every batch in flight (the staged ones and the training one)."""
    table_of = {f: name for name, _, _, fs in TABLES for f in fs}
    most = 1
    for start in range(len(batches)):
        window = batches[start : start + depth + 1]
        per_table: dict[str, set[int]] = {}
        for kjt in window:
            for f, jt in kjt.to_dict().items():
                per_table.setdefault(table_of[f], set()).update(jt.values().tolist())
        most = max([most, *(len(s) for s in per_table.values())])
    return most


def three_ways(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """Run every (kind, lookahead, depth, capacity fraction, seed) case; assert they agree."""
    return [_one_case(rank, world, *case) for case in cases]


def _one_case(
    rank: int,
    world: int,
    kind: str,
    lookahead: int,
    depth: int,
    fraction: float,
    seed: int,
    weighted: bool = False,
    hot: bool = False,
) -> dict:
    batches = sweep_batches(10, world, seed, weighted)
    need = in_flight_rows(batches, depth)
    biggest = max(rows for _, rows, _, _ in TABLES)
    capacity = need + round(fraction * (biggest - need))  # rows per table (or per shard)
    config = CacheConfig(capacity=capacity, lookahead=lookahead, prefetch_depth=depth)
    tables = {}
    if hot:  # some rows of t0, t1 and t3 replicated on every rank (the hottest: small ids)
        rows = {"t0": (0, 1, 2), "t1": (0, 1, 3, 2), "t3": (1, 0)}
        tables = {t: dataclasses.replace(config, hot_rows=r) for t, r in rows.items()}

    reference = make_ebc(weighted=weighted)
    integer_init(reference, seed)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1.0)
    ref_outputs = []
    for batch in batches:
        out = reference(batch)
        ref_opt.zero_grad()
        (loss_of(out) / world).backward()  # TorchRec's fused update: mean of the ranks' losses
        ref_opt.step()
        b = batch.stride() // world
        ref_outputs.append(
            {k: v[rank * b : (rank + 1) * b].detach() for k, v in out.to_dict().items()}
        )

    local = [
        Batch(
            dense_features=torch.zeros(kjt.stride() // world, 1),
            sparse_features=local_slice(kjt, rank, world),
            labels=torch.zeros(kjt.stride() // world),
        )
        for kjt in batches
    ]
    result = {"capacity": capacity, "need": need}
    for name in ("plain", "pipeline", "torchrec_prefetch"):
        ebc = make_ebc(weighted=weighted)
        integer_init(ebc, seed)
        state = {k: v.clone() for k, v in ebc.state_dict().items()}
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 1.0})
        model = per_table_plan(
            EbcTrain(ebc),
            "ebc",
            ebc,
            plan_for(kind, world),
            CachedEmbeddingBagCollectionSharder(config, tables),
            init_data_parallel=False,
        )
        copy_global_into(model, {f"ebc.{k}": v for k, v in state.items()})
        outputs = []
        if name == "plain":
            for batch in local:
                loss, out = model(batch)
                loss.backward()
                outputs.append(out)
        else:
            if name == "pipeline":
                pipeline = LookaheadTrainPipeline(
                    model, None, "cpu", lookahead=lookahead, prefetch_depth=depth
                )
            else:
                pipeline = CpuPrefetchPipeline(model, idle_optimizer())
            it = iter(local)
            while True:
                try:
                    outputs.append(pipeline.progress(it))
                except StopIteration:
                    break
        assert len(outputs) == len(batches), (name, len(outputs))
        for step, (out, expected) in enumerate(zip(outputs, ref_outputs, strict=True)):
            mine = out.to_dict()
            for key in FEATURES:
                assert torch.equal(mine[key].detach(), expected[key]), (name, step, key)
        compare_with_global(
            model, {f"ebc.{k}": v for k, v in reference.state_dict().items()}, exact=True
        )
        stats = cache_stats(model).values()
        result[name] = {
            "critical": sum(s.critical_misses for s in stats),
            "evictions": sum(s.evictions for s in stats),
            "loads": sum(s.loads for s in stats),
            "whole": all(s.capacity >= s.num_rows for s in stats),  # every cache holds its shard
        }
    dist.barrier()
    return result


class TwoTower(nn.Module):
    """Two EmbeddingBagCollections fed by two KeyedJaggedTensors of one batch."""

    def __init__(self, seed: int):
        super().__init__()
        self.user = make_ebc()
        self.item = make_ebc()
        integer_init(self.user, seed)
        integer_init(self.item, seed + 1)

    def forward(self, batch: dict):  # noqa: ANN201
        user, item = self.user(batch["user"]), self.item(batch["item"])
        return loss_of(user) + 2 * loss_of(item), (user, item)


def _two_tower_model(config: CacheConfig, world: int, state: dict) -> nn.Module:
    model = TwoTower(0)
    model.load_state_dict(state)
    for ebc in (model.user, model.item):
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 1.0})
    sharder = CachedEmbeddingBagCollectionSharder(config)
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    from tests.distributed.sharded_model import wrap

    plans = {
        path: construct_module_sharding_plan(
            getattr(model, path),
            per_param_sharding=plan_for(kind, world),
            local_size=world,
            world_size=world,
            device_type="cpu",
            sharder=sharder,
        )
        for path, kind in (("user", "table_wise"), ("item", "row_wise"))
    }
    dmp = wrap(model, ShardingPlan(plans), sharder, init_data_parallel=False)
    copy_global_into(dmp, state)  # DMP initializes shards afresh
    return dmp


def two_modules(rank: int, world: int) -> dict:
    """Pipelined == plain for a model with two distcache-sharded modules."""
    users, items = sweep_batches(8, world, 5), sweep_batches(8, world, 6)
    local = [
        {"user": local_slice(u, rank, world), "item": local_slice(i, rank, world)}
        for u, i in zip(users, items, strict=True)
    ]
    state = TwoTower(0).state_dict()
    config = CacheConfig(capacity=in_flight_rows(users + items, 1) + 4, lookahead=3)
    runs = {}
    for name in ("plain", "pipeline", "torchrec_prefetch"):
        model = _two_tower_model(config, world, state)
        outputs = []
        if name == "plain":
            for batch in local:
                loss, out = model(batch)
                loss.backward()
                outputs.append(out)
        else:
            try:
                LookaheadTrainPipeline(model, None, "cpu")
                raise AssertionError("two modules without sparse_input were accepted")
            except DistcacheConfigError as err:
                assert "sparse_input" in str(err)
            pipeline = LookaheadTrainPipeline(
                model, None, "cpu", sparse_input=lambda b: {"user": b["user"], "item": b["item"]}
            )
            it = iter(local)
            while True:
                try:
                    outputs.append(pipeline.progress(it))
                except StopIteration:
                    break
            stats = pipeline.stats()
            assert {k.split("/")[0] for k in stats if k != "total"} == {"user", "item"}, stats
            assert stats["total"]["critical_misses"] == 0
        runs[name] = {
            "outputs": [kt.values().detach() for pair in outputs for kt in pair],
            "weights": local_shards(model),
        }
    return runs


def failing_stage(rank: int, world: int) -> str:
    """A bad id in batch 4 raises from the `progress` that would train batch 4 (it was checked
    on the device when routed, L batches before, without a read-back); batches 0-3 train. The
    pipeline is then closed."""
    batches = sweep_batches(8, world, 9)
    local = [
        Batch(
            dense_features=torch.zeros(k.stride(), 1),
            sparse_features=k,
            labels=torch.zeros(k.stride()),
        )
        for k in batches
    ]
    bad = local[4].sparse_features
    values = bad.values().clone()
    values[0] = 10_000
    local[4].sparse_features = KeyedJaggedTensor.from_lengths_sync(
        bad.keys(), values, bad.lengths()
    )
    ebc = make_ebc()
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 1.0})
    model = per_table_plan(
        EbcTrain(ebc),
        "ebc",
        ebc,
        plan_for("table_wise", world),
        CachedEmbeddingBagCollectionSharder(CacheConfig(capacity=0.5, lookahead=2)),
        init_data_parallel=False,
    )
    for sparse_input, batch, said in (  # a batch without a KeyedJaggedTensor: named at once
        (None, (1, 2), "a batch of type tuple has no sparse_features; give batches like"),
        (lambda b: b.dense_features, local[0], "input of 'ebc' is a Tensor; expected a Keyed"),
    ):
        try:
            LookaheadTrainPipeline(model, None, "cpu", sparse_input=sparse_input).progress(
                iter([batch] * 3)
            )
            raise AssertionError(f"accepted {batch!r}")
        except DistcacheConfigError as err:
            assert said in str(err), err
    pipeline = LookaheadTrainPipeline(model, None, "cpu")
    it = iter(local)
    trained = 0
    try:
        while True:
            pipeline.progress(it)
            trained += 1
    except InvalidIdError as err:
        first = str(err)
    assert trained == 4, trained  # every batch before the bad one trained
    try:
        pipeline.progress(it)
    except LookaheadWindowError as err:
        return first + " | " + str(err)
    raise AssertionError("a failed pipeline kept going")
