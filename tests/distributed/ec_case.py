"""Rank bodies for `EmbeddingCollection` tests: a small EC (sequence features), its batches,
plans and the comparison against the unsharded, uncached EC."""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.streamable import Pipelineable

from distcache import CacheConfig
from distcache.pipeline import LookaheadTrainPipeline
from distcache.sharding import (
    CACHED_KERNEL,
    CachedEmbeddingBagCollectionSharder,
    CachedEmbeddingCollectionSharder,
    cache_stats,
)
from tests.distributed.prefetch_pipeline import CpuPrefetchPipeline, idle_optimizer
from tests.distributed.sharded_model import (
    TABLES,
    compare_with_global,
    copy_global_into,
    evaluated,
    global_batches,
    integer_init,
    local_shards,
    local_slice,
    loss_of,
    make_ebc,
    plan_for,
    wrap,
)

DIM = 8
# (name, rows, features): one width (as EmbeddingCollection requires); s2 serves two features.
SEQ_TABLES = [("s0", 40, ["q0"]), ("s1", 64, ["q1"]), ("s2", 50, ["q2", "q3"])]
SEQ_FEATURES = [f for *_, fs in SEQ_TABLES for f in fs]


def make_ec(data_type: str = "FP32") -> EmbeddingCollection:
    from torchrec.modules.embedding_configs import DataType

    configs = [
        EmbeddingConfig(
            name=n,
            num_embeddings=r,
            embedding_dim=DIM,
            feature_names=fs,
            data_type=DataType[data_type],
        )
        for n, r, fs in SEQ_TABLES
    ]
    return EmbeddingCollection(tables=configs, device=torch.device("cpu"))


def seq_batches(num: int, batch_per_rank: int, world: int, seed: int) -> list[KeyedJaggedTensor]:
    """Global batches of power-law id sequences (0 to 5 ids per sample, some empty)."""
    gen = torch.Generator().manual_seed(seed)
    rows = {f: r for _, r, fs in SEQ_TABLES for f in fs}
    out = []
    for _ in range(num):
        b = world * batch_per_rank
        lengths = torch.randint(0, 6, (len(SEQ_FEATURES) * b,), generator=gen)
        values = []
        for k, f in enumerate(SEQ_FEATURES):
            n = int(lengths[k * b : (k + 1) * b].sum())
            u = torch.rand(n, generator=gen)
            values.append(((rows[f] ** u).long() - 1).clamp(0, rows[f] - 1))
        out.append(
            KeyedJaggedTensor.from_lengths_sync(
                keys=SEQ_FEATURES, values=torch.cat(values), lengths=lengths
            )
        )
    return out


def local_seq_slice(kjt: KeyedJaggedTensor, rank: int, world: int) -> KeyedJaggedTensor:
    """Rank `rank`'s samples of a global batch."""
    b = kjt.stride() // world
    per_key = kjt.to_dict()
    lengths, values = [], []
    for f in SEQ_FEATURES:
        jt = per_key[f]
        lens = jt.lengths()
        start = int(lens[: rank * b].sum())
        stop = start + int(lens[rank * b : (rank + 1) * b].sum())
        lengths.append(lens[rank * b : (rank + 1) * b])
        values.append(jt.values()[start:stop])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=SEQ_FEATURES, values=torch.cat(values), lengths=torch.cat(lengths)
    )


def ec_plan(kind: str, world: int) -> dict:
    ranks = list(range(world))
    per_table = {
        "table_wise": lambda i: table_wise(rank=i % world, compute_kernel=CACHED_KERNEL),
        "row_wise": lambda i: row_wise(compute_kernel=CACHED_KERNEL),
        "column_wise": lambda i: column_wise(ranks=ranks, compute_kernel=CACHED_KERNEL),
        "mixed": lambda i: [
            table_wise(rank=1 % world, compute_kernel=CACHED_KERNEL),
            row_wise(compute_kernel=CACHED_KERNEL),
            table_wise(rank=0, compute_kernel=CACHED_KERNEL),
        ][i],
    }[kind]
    return {name: per_table(i) for i, (name, *_) in enumerate(SEQ_TABLES)}


def shard_ec(
    model: torch.nn.Module,
    path: str,
    ec: EmbeddingCollection,
    kind: str,
    config: CacheConfig,
    table_configs: dict[str, CacheConfig] | None = None,
):
    """`model` under DMP with the EC at `path` sharded by `kind`, cached by `config`."""
    world = dist.get_world_size()
    sharder = CachedEmbeddingCollectionSharder(config, table_configs)
    module_plan = construct_module_sharding_plan(
        ec,
        per_param_sharding=ec_plan(kind, world),
        local_size=world,
        world_size=world,
        device_type="cpu",
        sharder=sharder,
    )
    return wrap(model, ShardingPlan({path: module_plan}), sharder, init_data_parallel=False)


def seq_loss(per_feature: dict) -> torch.Tensor:
    """An integer-gradient loss over every id's row, features in a fixed order."""
    rows = torch.cat([per_feature[f].values() for f in SEQ_FEATURES])
    weights = torch.arange(rows.numel(), dtype=rows.dtype).view_as(rows) % 3 - 1
    return (rows * weights).sum()


def train_ec_and_compare(
    rank: int,
    world: int,
    kind: str,
    *,
    capacity: int = 16,
    steps: int = 10,
    hot: bool | str = False,
    optimizer: str = "sgd",
) -> dict:
    """Train a cached, sharded EC and the unsharded EC side by side on the same batches (SGD,
    integer rows and gradients): per-id outputs and final rows must be bitwise equal.

    `hot`: s0 and s2 (two features) replicate their hottest rows on every rank
    (`CacheConfig.hot_rows`); `hot="touched"`: s2 reduces its touched rows, s0 all its rows.
    `optimizer="adam"`: lazy Adam (TorchRec's row-wise semantics:
    rows no rank touched keep their value and moments), compared within float tolerance."""
    torch.manual_seed(0)
    reference = make_ec()
    integer_init(reference)
    src = make_ec()
    src.load_state_dict(reference.state_dict())
    exact = optimizer == "sgd"
    lr = 1.0 if exact else 0.1
    if exact:
        apply_optimizer_in_backward(torch.optim.SGD, src.embeddings.parameters(), {"lr": lr})
        ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    else:
        ref_opt = _LazyAdam(reference, lr)
    config = CacheConfig(capacity=capacity, lookahead=2, optimizer=optimizer, learning_rate=lr)
    # s2 serves two features: a larger cache of its own.
    big = {"s2": dataclasses.replace(config, capacity=2 * capacity)}
    if hot:  # the power law's hottest ids are the smallest
        big = {
            "s0": dataclasses.replace(config, hot_rows=(0, 1, 2)),
            "s2": dataclasses.replace(
                big["s2"],
                hot_rows=(3, 0, 1, 2),
                hot_reduce="touched" if hot == "touched" else "all",
            ),
        }
    model = shard_ec(src, "", src, kind, config, big)
    copy_global_into(model, reference.state_dict())
    for step, batch in enumerate(seq_batches(steps, 3, world, seed=5)):
        mine = model(local_seq_slice(batch, rank, world))
        seq_loss(mine).backward()
        theirs = reference(batch)
        ref_opt.zero_grad()
        # TorchRec's fused update follows the gradient of the mean of the ranks' losses (its
        # sequence all-to-all divides gradients by the world size, as the pooled one does).
        (
            sum(seq_loss(_rank_slice(theirs, r, world, batch)) for r in range(world)) / world
        ).backward()
        ref_opt.step() if exact else ref_opt.step(batch)
        for f in SEQ_FEATURES:
            expected = _rank_slice(theirs, rank, world, batch)[f]
            assert torch.equal(mine[f].lengths(), expected.lengths()), (step, f)
            a, b = mine[f].values().detach(), expected.values().detach()
            assert torch.equal(a, b) if exact else torch.allclose(a, b, atol=1e-5), (step, f)
    compare_with_global(model, reference.state_dict(), exact=exact)
    if hot == "touched":  # s2's touched rows went through the all-gather
        gathered = model._dmp_wrapped_module._hot._reduction.gathered
        assert [span.name for span in gathered] == ["s2"], gathered
    return {name: s.as_dict() for name, s in cache_stats(model).items()}


def _rank_slice(per_feature: dict, rank: int, world: int, batch: KeyedJaggedTensor) -> dict:
    """The unsharded EC's output for rank `rank`'s samples (values keep their autograd graph)."""
    from torchrec import JaggedTensor

    b = batch.stride() // world
    out = {}
    for f, jt in per_feature.items():
        lens = jt.lengths()
        start = int(lens[: rank * b].sum())
        stop = start + int(lens[rank * b : (rank + 1) * b].sum())
        out[f] = JaggedTensor(
            values=jt.values()[start:stop], lengths=lens[rank * b : (rank + 1) * b]
        )
    return out


@dataclasses.dataclass
class BagsAndSeq(Pipelineable):
    """One batch's two KeyedJaggedTensors (`Pipelineable`, as TorchRec's pipelines need)."""

    bags: KeyedJaggedTensor
    seq: KeyedJaggedTensor

    def to(self, device: torch.device, non_blocking: bool = False) -> BagsAndSeq:
        return BagsAndSeq(
            self.bags.to(device, non_blocking=non_blocking),
            self.seq.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.bags.record_stream(stream)
        self.seq.record_stream(stream)


class BagsAndSequences(nn.Module):
    """A model with an EmbeddingBagCollection (pooled features) and an EmbeddingCollection
    (sequence features), fed by the two KeyedJaggedTensors of a `BagsAndSeq` batch."""

    def __init__(self):
        super().__init__()
        self.bags = make_ebc()
        self.seq = make_ec()
        integer_init(self.bags, 1)
        integer_init(self.seq, 2)

    def forward(self, batch: BagsAndSeq):  # noqa: ANN201
        pooled, per_id = self.bags(batch.bags), self.seq(batch.seq)
        return loss_of(pooled) + 2 * seq_loss(per_id), (pooled, per_id)


def _shard_both(state: dict, config: CacheConfig, world: int, hot: bool = False) -> nn.Module:
    """`hot`: t0 and s0, s2 replicate their hottest rows."""
    model = BagsAndSequences()
    model.load_state_dict(state)
    for module in (model.bags, model.seq):
        apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": 1.0})
    bag_tables, seq_tables = {"t3": _twice(config)}, {"s2": _twice(config)}
    if hot:
        bag_tables["t0"] = dataclasses.replace(config, hot_rows=(0, 1, 2))
        seq_tables["s0"] = dataclasses.replace(config, hot_rows=(0, 1))
        seq_tables["s2"] = dataclasses.replace(seq_tables["s2"], hot_rows=(2, 0, 1))
    bag_sharder = CachedEmbeddingBagCollectionSharder(config, bag_tables)
    seq_sharder = CachedEmbeddingCollectionSharder(config, seq_tables)
    plans = {
        "bags": construct_module_sharding_plan(
            model.bags,
            per_param_sharding=plan_for("mixed", world),
            local_size=world,
            world_size=world,
            device_type="cpu",
            sharder=bag_sharder,
        ),
        "seq": construct_module_sharding_plan(
            model.seq,
            per_param_sharding=ec_plan("mixed", world),
            local_size=world,
            world_size=world,
            device_type="cpu",
            sharder=seq_sharder,
        ),
    }
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=ShardingPlan(plans),
        sharders=[bag_sharder, seq_sharder],
        init_data_parallel=False,
    )
    copy_global_into(dmp, state)  # DMP initializes shards afresh
    return dmp


def _twice(config: CacheConfig) -> CacheConfig:
    return dataclasses.replace(config, capacity=2 * config.capacity)


def bags_and_sequences_pipelined_vs_plain(
    rank: int, world: int, steps: int = 10, hot: bool = False
) -> dict:
    """An EBC and an EC in one model: `LookaheadTrainPipeline`, and TorchRec's
    `TrainPipelineSparseDist` and `PrefetchTrainPipelineSparseDist` (its streams emulated),
    against the plain loop (`hot`: with hot rows in both). Distcache's pipeline also
    evaluates, after steps 3 and 5, another batch and the next training batch, as the plain
    loop does in its run `plain_evaluated` (`evaluated`)."""
    bags = global_batches(steps + 1, 3, world, seed=7)
    seqs = seq_batches(steps + 1, 3, world, seed=8)
    local = [
        BagsAndSeq(local_slice(b, rank, world), local_seq_slice(s, rank, world))
        for b, s in zip(bags, seqs, strict=True)
    ]
    local, other = local[:steps], local[steps]
    evaluate = {3: other, 5: local[6]}
    state = BagsAndSequences().state_dict()
    config = CacheConfig(capacity=24, lookahead=3, prefetch_depth=1)
    runs = {}
    names = ("plain", "plain_evaluated", "pipeline", "torchrec_pipeline", "torchrec_prefetch")
    for name in names:
        model = _shard_both(state, config, world, hot)
        outputs, evaluations = [], []
        if name in ("plain", "plain_evaluated"):
            for step, batch in enumerate(local):
                loss, out = model(batch)
                loss.backward()
                outputs.append(out)
                if name == "plain_evaluated":  # (its evaluations stage rows: not counted)
                    evaluations += _evaluated(model, evaluate.get(step))
        elif name == "pipeline":
            pipeline = LookaheadTrainPipeline(
                model, None, "cpu", sparse_input=lambda b: {"bags": b.bags, "seq": b.seq}
            )
            it = iter(local)
            for step in range(steps):
                outputs.append(pipeline.progress(it))
                evaluations += _evaluated(model, evaluate.get(step))
        else:
            if name == "torchrec_pipeline":
                pipeline = TrainPipelineSparseDist(model, idle_optimizer(), torch.device("cpu"))
            else:
                pipeline = CpuPrefetchPipeline(model, idle_optimizer())
            it = iter(local)
            while True:
                try:
                    outputs.append(pipeline.progress(it))
                except StopIteration:
                    break
        if name == "pipeline":
            stats = pipeline.stats()
            assert {k.split("/")[0] for k in stats if k != "total"} == {"bags", "seq"}, stats
            runs["evictions"] = stats["total"]["evictions"]
        runs[f"{name}_critical"] = sum(s.critical_misses for s in cache_stats(model).values())
        runs[name] = {
            "outputs": _flat(outputs),
            "evaluated": _flat(evaluations),
            "weights": local_shards(model),
        }
    return runs


def loaded_between_steps(rank: int, world: int, steps: int = 10) -> dict:
    """An EBC and an EC in one model, with hot rows, in the plain loop and under
    `LookaheadTrainPipeline`, each loading after step 3 the state it saved after step 1 (the
    caches and the replicas purged, the window kept): per loop its outputs and local shards."""
    bags = global_batches(steps, 3, world, seed=7)
    seqs = seq_batches(steps, 3, world, seed=8)
    local = [
        BagsAndSeq(local_slice(b, rank, world), local_seq_slice(s, rank, world))
        for b, s in zip(bags, seqs, strict=True)
    ]
    state = BagsAndSequences().state_dict()
    config = CacheConfig(capacity=24, lookahead=3, prefetch_depth=1)
    runs = {}
    for name in ("plain", "pipeline"):
        model = _shard_both(state, config, world, hot=True)
        pipeline = None
        if name == "pipeline":
            pipeline = LookaheadTrainPipeline(
                model, None, "cpu", sparse_input=lambda b: {"bags": b.bags, "seq": b.seq}
            )
        it, outputs, saved = iter(local), [], None
        for step in range(steps):
            if pipeline is None:
                loss, out = model(next(it))
                loss.backward()
            else:
                out = pipeline.progress(it)
            outputs.append(out)
            if step == 1:
                saved = copy.deepcopy(model.state_dict())
            if step == 3:  # (batches are still routed after it: not only the window's)
                model.load_state_dict(saved)
        runs[name] = {
            "outputs": _flat(outputs),
            "weights": local_shards(model),
        }
    return runs


def _evaluated(model: torch.nn.Module, batch: BagsAndSeq | None) -> list:
    """`model`'s output for `batch` in eval mode, without gradients ([] for None)."""
    return [] if batch is None else [evaluated(model, batch)[1]]


def _flat(outputs: list) -> list[torch.Tensor]:
    """The values of each (pooled, per-id) output, in order."""
    return [
        t.detach()
        for pooled, per_id in outputs
        for t in [pooled.values()] + [per_id[f].values() for f in SEQ_FEATURES]
    ]


def planner_plans_bags_and_sequences(rank: int, world: int) -> dict:
    """`CachedShardingPlanner` over a model with an EBC and an EC: every table gets
    distcache's kernel and its own sharder's `CacheConfig`, and the model trains."""
    from distcache.sharding import CachedShardingPlanner

    model = BagsAndSequences()
    for module in (model.bags, model.seq):
        apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": 0.1})
    config = CacheConfig(capacity=0.5, lookahead=2)
    bag_sharder = CachedEmbeddingBagCollectionSharder(config, {"t3": _twice(config)})
    seq_sharder = CachedEmbeddingCollectionSharder(_twice(config))
    sharders = [bag_sharder, seq_sharder]
    planner = CachedShardingPlanner(batch_size=3)
    plan = planner.collective_plan(model, sharders, dist.group.WORLD)
    # The planner raises a cache that cannot hold 2 batches of 3 samples x 2 ranks.
    raised = {s.table: s for s in planner.shortfalls}
    configs = {
        f"{path}.{name}": (p.sharding_type, p.compute_kernel, p.cache_config)
        for path, module_plan in plan.plan.items()
        for name, p in module_plan.items()
    }
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=plan,
        sharders=sharders,
    )
    bags = global_batches(4, 3, world, seed=3)
    seqs = seq_batches(4, 3, world, seed=4)
    for b, s in zip(bags, seqs, strict=True):
        loss, _ = dmp(BagsAndSeq(local_slice(b, rank, world), local_seq_slice(s, rank, world)))
        loss.backward()
    return {
        "configs": configs,
        "expected": {
            **{f"bags.{n}": _held(bag_sharder.config_for(n), raised.get(n)) for n, *_ in TABLES},
            **{f"seq.{n}": _held(seq_sharder.config_for(n), raised.get(n)) for n, *_ in SEQ_TABLES},
        },
        "raised": sorted(raised),
        "batches": sum(s.batches for s in cache_stats(dmp).values()),
    }


def _held(config: CacheConfig, short) -> CacheConfig:  # noqa: ANN001
    """The sharder's `config`, raised where the planner found it too small (`short`)."""
    return config if short is None else short.raised(config)


def ec_with_bad_id(rank: int, world: int, bad_id: int) -> None:
    """Rank 1's third batch holds `bad_id` for feature q1 (table s1, 64 rows)."""
    ec = make_ec()
    apply_optimizer_in_backward(torch.optim.SGD, ec.embeddings.parameters(), {"lr": 0.1})
    model = shard_ec(ec, "", ec, "row_wise", CacheConfig(capacity=0.5))
    for step, batch in enumerate(seq_batches(4, 2, world, seed=3)):
        local = local_seq_slice(batch, rank, world)
        if rank == 1 and step == 2:
            values = local.values().clone()
            values[local.length_per_key()[0]] = bad_id  # the first id of feature q1
            local = KeyedJaggedTensor.from_lengths_sync(SEQ_FEATURES, values, local.lengths())
        seq_loss(model(local)).backward()


class _LazyAdam:
    """The reference of a fused Adam for the EC (`torch.optim.SparseAdam`): only the rows the
    global batch touched are updated, their moments included."""

    def __init__(self, ec: EmbeddingCollection, lr: float):
        self.ec = ec
        self.adam = torch.optim.SparseAdam(
            [ec.embeddings[name].weight for name, *_ in SEQ_TABLES], lr=lr
        )

    def zero_grad(self) -> None:
        self.adam.zero_grad()

    def step(self, batch: KeyedJaggedTensor) -> None:
        features = batch.to_dict()
        for name, _, feats in SEQ_TABLES:
            weight = self.ec.embeddings[name].weight
            ids = torch.cat([features[f].values() for f in feats]).unique()
            grad = weight.grad.index_select(0, ids)
            weight.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), grad, weight.shape)
        self.adam.step()


def ec_hot_rows_on_torchrecs_kernel(rank: int, world: int) -> None:
    """s0 on TorchRec's own kernel (`fused`) with hot rows: refused when sharded."""
    ec = make_ec()
    config = CacheConfig(capacity=16, lookahead=2)
    sharder = CachedEmbeddingCollectionSharder(
        config, {"s0": dataclasses.replace(config, hot_rows=(0, 1))}
    )
    per_param = ec_plan("table_wise", world)
    per_param["s0"] = table_wise(rank=0, compute_kernel="fused")
    module_plan = construct_module_sharding_plan(
        ec, per_param_sharding=per_param, local_size=world, world_size=world,
        device_type="cpu", sharder=sharder,
    )  # fmt: skip
    wrap(ec, ShardingPlan({"": module_plan}), sharder, init_data_parallel=False)


def sequence_bytes_match_the_model(rank: int, world: int, sharding: str) -> dict:
    """Two sequence tables (`TableStats.pooled` False) placed by `uniform_plan(sharding)`,
    exported by `to_sharding_plan` and sharded by TorchRec's own `EmbeddingCollectionSharder`
    (TorchRec's kernel and dists: the reference): the bytes this rank sends in one step's
    all-to-alls (`CollectiveBytes`), with the bytes the cost model prices
    (`all_to_all_sent_bytes`) for every sample holding exactly `POOLING` ids a feature."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder

    from distcache.planner.cost import all_to_all_sent_bytes
    from distcache.planner.solver import uniform_plan
    from distcache.planner.topology import preset
    from distcache.planner.torchrec.export import to_sharding_plan, workload_ec
    from distcache.planner.types import TableStats, Workload
    from distcache.tools.collectives import CollectiveBytes

    batch, pooling, dim = 6, 3, 8
    workload = Workload(
        name="seq",
        tables=tuple(
            TableStats(name=n, rows=r, dim=dim, pooling_factor=pooling, pooled=False)
            for n, r in (("s0", 40), ("s1", 64))
        ),
        batch_size_per_rank=batch,
    )
    topology = preset("cpu", world_size=world)
    plan = uniform_plan(workload, topology, sharding)
    torch.manual_seed(0)
    ec = workload_ec(workload, device="cpu")
    apply_optimizer_in_backward(torch.optim.SGD, ec.parameters(), {"lr": 0.1})
    model = DistributedModelParallel(
        ec,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=to_sharding_plan(plan, workload, world_size=world),
        sharders=[EmbeddingCollectionSharder()],
    )
    features = [t.name for t in workload.tables]
    gen = torch.Generator().manual_seed(rank)
    sent = []
    for _ in range(3):  # the first steps set TorchRec's dists up; the last is counted
        lengths = torch.full((len(features) * batch,), pooling)
        values = torch.cat([torch.randint(0, t.rows, (batch * pooling,), generator=gen)
                            for t in workload.tables])  # fmt: skip
        kjt = KeyedJaggedTensor.from_lengths_sync(features, values, lengths)
        with CollectiveBytes() as counted:
            out = model(kjt)
            sum(out[f].values().sum() for f in features).backward()
        sent.append(counted.all_to_all)
    modelled = float(all_to_all_sent_bytes(plan, workload, topology)[rank])
    return {"measured": sent[-1], "modelled": modelled, "bags": len(features) * batch}
