"""Shared pieces of the distributed tests: a small EBC, its batches, plans and comparisons."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from distcache import CacheConfig
from distcache.sharding import (
    CACHED_KERNEL,
    CachedEmbeddingBagCollectionSharder,
    attach_cache_configs,
    cache_stats,
    cached_estimators,
)
from distcache.sharding.compact_dist import CompactPooledEmbeddingDist

# (name, rows, dim, features): tables of different sizes and widths; t3 serves two features.
TABLES = [
    ("t0", 40, 8, ["f0"]),
    ("t1", 64, 8, ["f1"]),
    ("t2", 30, 4, ["f2"]),
    ("t3", 50, 16, ["f3", "f4"]),
]
FEATURES = [f for *_, fs in TABLES for f in fs]


def make_ebc(
    pooling: str = "sum", data_type: str = "FP32", weighted: bool = False
) -> EmbeddingBagCollection:
    from torchrec.modules.embedding_configs import DataType, PoolingType

    kind = PoolingType.SUM if pooling == "sum" else PoolingType.MEAN
    configs = [
        EmbeddingBagConfig(
            name=n,
            num_embeddings=r,
            embedding_dim=d,
            feature_names=fs,
            pooling=kind,
            data_type=DataType[data_type],
        )
        for n, r, d, fs in TABLES
    ]
    return EmbeddingBagCollection(tables=configs, is_weighted=weighted, device=torch.device("cpu"))


def integer_init(ebc: EmbeddingBagCollection, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(ebc.named_parameters()):
            param.copy_(torch.randint(-8, 8, param.shape, generator=gen).float())


def global_batches(
    num: int, batch_per_rank: int, world: int, seed: int, weighted: bool = False
) -> list[KeyedJaggedTensor]:
    """Global batches (world * batch_per_rank samples) of power-law ids, some bags empty;
    `weighted`: with an integer weight in [1, 3] per id."""
    gen = torch.Generator().manual_seed(seed)
    weight_gen = torch.Generator().manual_seed(seed + 1)
    rows = {f: r for _, r, _, fs in TABLES for f in fs}
    out = []
    for _ in range(num):
        b = world * batch_per_rank
        lengths = torch.randint(0, 4, (len(FEATURES) * b,), generator=gen)
        values = []
        for k, f in enumerate(FEATURES):
            n = int(lengths[k * b : (k + 1) * b].sum())
            u = torch.rand(n, generator=gen)
            values.append(((rows[f] ** u).long() - 1).clamp(0, rows[f] - 1))
        ids = torch.cat(values)
        weights = torch.randint(1, 4, ids.shape, generator=weight_gen).float() if weighted else None
        out.append(
            KeyedJaggedTensor.from_lengths_sync(
                keys=FEATURES, values=ids, lengths=lengths, weights=weights
            )
        )
    return out


def local_slice(kjt: KeyedJaggedTensor, rank: int, world: int) -> KeyedJaggedTensor:
    """Rank `rank`'s samples of a global batch."""
    b = kjt.stride() // world
    lengths = kjt.lengths().view(len(FEATURES), -1)
    sizes = lengths.sum(1).tolist()
    values = kjt.values().split(sizes)
    weights = None if kjt.weights_or_none() is None else kjt.weights().split(sizes)
    per_feature_len, per_feature_val, per_feature_weight = [], [], []
    for k in range(len(FEATURES)):
        lens = lengths[k]
        start = int(lens[: rank * b].sum())
        stop = start + int(lens[rank * b : (rank + 1) * b].sum())
        per_feature_len.append(lens[rank * b : (rank + 1) * b])
        per_feature_val.append(values[k][start:stop])
        if weights is not None:
            per_feature_weight.append(weights[k][start:stop])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=FEATURES,
        values=torch.cat(per_feature_val),
        lengths=torch.cat(per_feature_len),
        weights=torch.cat(per_feature_weight) if weights is not None else None,
    )


def plan_for(kind: str, world: int) -> dict:
    """One sharding type for every table, with distcache's kernel."""
    ranks = list(range(world))
    per_table = {
        "table_wise": lambda i: table_wise(rank=i % world, compute_kernel=CACHED_KERNEL),
        "row_wise": lambda i: row_wise(compute_kernel=CACHED_KERNEL),
        "column_wise": lambda i: column_wise(ranks=ranks, compute_kernel=CACHED_KERNEL),
        "table_row_wise": lambda i: table_row_wise(host_index=0),
        "mixed": lambda i: [
            table_wise(rank=1 % world, compute_kernel=CACHED_KERNEL),
            row_wise(compute_kernel=CACHED_KERNEL),
            column_wise(ranks=ranks, compute_kernel=CACHED_KERNEL),
            table_wise(rank=0, compute_kernel=CACHED_KERNEL),
        ][i],
    }[kind]
    return {name: per_table(i) for i, (name, *_) in enumerate(TABLES)}


def wrap(
    model: torch.nn.Module, plan: ShardingPlan, sharder, *, init_data_parallel: bool = True
) -> DistributedModelParallel:
    """`model` under DMP with `plan` on this CPU process group."""
    return DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=plan,
        sharders=[sharder],
        init_data_parallel=init_data_parallel,
    )


def per_table_plan(
    model: torch.nn.Module,
    path: str,
    ebc: EmbeddingBagCollection,
    per_table: dict,
    sharder,
    kernel: str | dict[str, str] = CACHED_KERNEL,
    **kwargs,
) -> DistributedModelParallel:
    """`model` under DMP with the EBC at `path` sharded by hand, table by table, on `kernel`
    (with distcache's sharder; one for every table, or per table)."""
    world = dist.get_world_size()
    module_plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding=per_table,
        local_size=world,
        world_size=world,
        device_type="cpu",
        sharder=sharder,
    )
    if isinstance(sharder, CachedEmbeddingBagCollectionSharder):
        for name, sharding in module_plan.items():  # table_row_wise() takes no compute kernel
            sharding.compute_kernel = kernel if isinstance(kernel, str) else kernel[name]
    return wrap(model, ShardingPlan({path: module_plan}), sharder, **kwargs)


def shard(
    ebc: EmbeddingBagCollection,
    kind: str,
    config: CacheConfig,
    table_configs: dict[str, CacheConfig] | None = None,
    kernel: str = CACHED_KERNEL,
) -> DistributedModelParallel:
    world = dist.get_world_size()
    sharder = CachedEmbeddingBagCollectionSharder(config, table_configs)
    if kind == "planner":  # TorchRec's planner chooses, on this CPU topology
        topology = Topology(world_size=world, compute_device="cpu")
        enumerator = EmbeddingEnumerator(topology, 8, estimator=cached_estimators(topology))
        planner = EmbeddingShardingPlanner(topology=topology, enumerator=enumerator)
        plan = planner.collective_plan(ebc, [sharder], dist.group.WORLD)
        return wrap(ebc, attach_cache_configs(plan, sharder), sharder, init_data_parallel=False)
    return per_table_plan(
        ebc, "", ebc, plan_for(kind, world), sharder, kernel, init_data_parallel=False
    )


def copy_global_into(model: torch.nn.Module, global_state: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict into a sharded model's local shards (dense entries, which
    DMP leaves unsharded, are skipped: they were copied with the model)."""
    for key, value in model.state_dict().items():
        if not hasattr(value, "local_shards"):
            continue
        source = global_state[key.removeprefix("module.")]
        for shard in value.local_shards():
            rows, cols = shard.metadata.shard_offsets
            n, d = shard.metadata.shard_sizes
            shard.tensor.copy_(source[rows : rows + n, cols : cols + d])


def compare_with_global(
    model: torch.nn.Module, global_state: dict[str, torch.Tensor], exact: bool
) -> None:
    for key, value in model.state_dict().items():
        source = global_state[key.removeprefix("module.")]
        for shard in value.local_shards():
            rows, cols = shard.metadata.shard_offsets
            n, d = shard.metadata.shard_sizes
            expected = source[rows : rows + n, cols : cols + d]
            if exact:
                assert torch.equal(shard.tensor, expected), key
            else:
                torch.testing.assert_close(shard.tensor, expected, msg=key)


def _prefetch(sharded, kjt: KeyedJaggedTensor) -> None:
    """TorchRec's prefetch hook: route a future batch's ids, hand them to the kernels."""
    ctx = sharded.create_context()
    dist_input = sharded.input_dist(ctx, kjt).wait().wait()
    sharded.prefetch(dist_input=dist_input, forward_stream=None, ctx=ctx)


def local_shards(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """A copy of this rank's shards of each sharded tensor of `model`'s state dict."""
    return {
        k: [s.tensor.clone() for s in v.local_shards()]
        for k, v in model.state_dict().items()
        if hasattr(v, "local_shards")
    }


def evaluated(model: torch.nn.Module, batch):  # noqa: ANN001, ANN201
    """`model(batch)` in eval mode, without gradients; the model is left in training mode."""
    model.eval()
    with torch.no_grad():
        out = model(batch)
    model.train()
    return out


def loss_of(kt) -> torch.Tensor:
    """An integer-gradient loss over the features in a fixed order (a sharded KeyedTensor orders
    its keys by shard placement, so `.values()` columns differ from the unsharded module's)."""
    per_key = kt.to_dict()
    values = torch.cat([per_key[f] for f in FEATURES], dim=1)
    weights = torch.arange(values.shape[1], dtype=values.dtype) % 3 - 1
    return (values * weights).sum()


def train_and_compare(
    rank: int,
    world: int,
    kind: str,
    *,
    optimizer: str = "sgd",
    capacity: float | int = 14,
    steps: int = 12,
    pooling: str = "sum",
    prefetch: bool = False,
    weighted: bool = False,
    hot: bool = False,
    kernel: str = CACHED_KERNEL,
    lr_halved_at: int | None = None,
    report_output: bool = False,
    hot_reduce: str = "all",
    graphs: bool = False,
    staging: str = "worker",
    scheduler_thread: bool = False,
) -> dict:
    """Train sharded+cached and unsharded side by side on the same batches; compare.
    `graphs`: the caches replay their scheduling as graphs (`CacheConfig.cuda_graphs`).
    `staging`: `CacheConfig.staging` (with `graphs`, "direct" is what CUDA runs by default).
    `scheduler_thread`: the caches' scheduling calls on a thread of their own
    (`CacheConfig.scheduler_thread`).
    `hot`: t0, t1 and t3 replicate their hottest rows on every rank (`CacheConfig.hot_rows`).
    `hot_reduce`: how their gradients are summed (`CacheConfig.hot_reduce`); "mixed": t0 and t3
    all-gather their touched rows, t1 all-reduces all of its.
    `kernel`: the tables' compute kernel ("fused": TorchRec's, with only the hot rows ours).
    `lr_halved_at`: after that step, the learning rate is halved in the model's fused optimizer
    (as an LR scheduler does; its `step()` hands it to FBGEMM's kernels) and the reference's.
    `report_output`: return the pooled output elements this rank sent through compact output
    dists, and TorchRec's dists would have, instead of the cache counters."""
    torch.manual_seed(0)
    # Bitwise where fp32 is exact: SGD on integers, sum pooling, and a world size whose 1/world
    # gradient scaling (TorchRec's mean over ranks) is a power of two.
    exact = optimizer == "sgd" and pooling == "sum" and world in (1, 2, 4)
    opt_cls, kwargs = {
        "sgd": (torch.optim.SGD, {"lr": 1.0}),
        "rowwise_adagrad": (RowWiseAdagrad, {"lr": 0.1, "eps": 1e-6}),
        "adam": (torch.optim.Adam, {"lr": 0.1, "eps": 1e-6}),
    }[optimizer]
    reference = make_ebc(pooling, weighted=weighted)
    integer_init(reference)
    sharded_src = make_ebc(pooling, weighted=weighted)
    sharded_src.load_state_dict(reference.state_dict())
    config = CacheConfig(
        capacity=capacity, lookahead=2, prefetch_depth=1, cuda_graphs=graphs, staging=staging,
        scheduler_thread=scheduler_thread,
    )  # fmt: skip
    # The optimizer is configured the TorchRec way; the kernel's CacheConfig takes it from there.
    apply_optimizer_in_backward(opt_cls, sharded_src.embedding_bags.parameters(), kwargs)
    ref_opt = (
        _LazyAdam(reference, **kwargs)
        if optimizer == "adam"
        else opt_cls(reference.parameters(), **kwargs)
    )
    # t3 serves two features: a per-table override gives it a larger cache (its own group).
    big = dataclasses.replace(config, capacity=2 * capacity if isinstance(capacity, int) else 1.0)
    tables = {"t3": big}
    if hot:  # the power law's hottest ids are the smallest
        gather = "all" if hot_reduce == "all" else "touched"
        tables = {
            "t0": dataclasses.replace(config, hot_rows=(0, 1, 2, 3), hot_reduce=gather),
            "t1": dataclasses.replace(
                config,
                hot_rows=(5, 0, 1, 2, 3, 4),
                hot_reduce="all" if hot_reduce == "mixed" else gather,
            ),
            "t3": dataclasses.replace(big, hot_rows=(0, 2, 1), hot_reduce=gather),
        }
    model = shard(sharded_src, kind, config, tables, kernel)
    copy_global_into(model, reference.state_dict())
    batches = global_batches(steps, 3, world, seed=1, weighted=weighted)  # 3 samples per rank
    sharded = model._dmp_wrapped_module
    if prefetch:
        _prefetch(sharded, local_slice(batches[0], rank, world))
    for step, batch in enumerate(batches):
        out = model(local_slice(batch, rank, world))
        if prefetch and step + 1 < len(batches):  # stage the next batch while this one is in flight
            _prefetch(sharded, local_slice(batches[step + 1], rank, world))
        loss_of(out).backward()
        ref_out = reference(batch)
        # TorchRec's fused update follows the gradient of the mean of the ranks' losses.
        ref_opt.zero_grad()
        (loss_of(ref_out) / world).backward()
        ref_opt.step(batch) if optimizer == "adam" else ref_opt.step()
        if step == lr_halved_at:
            for opt in (model.fused_optimizer, getattr(ref_opt, "adam", ref_opt)):
                for group in opt.param_groups:
                    group["lr"] /= 2
            model.fused_optimizer.step()  # no update (fused in backward): sets FBGEMM's rate
        mine, theirs = out.to_dict(), ref_out.to_dict()
        b = batch.stride() // world
        for key in FEATURES:
            expected = theirs[key][rank * b : (rank + 1) * b].detach()
            if exact:
                assert torch.equal(mine[key].detach(), expected), (step, key)
            else:
                torch.testing.assert_close(mine[key].detach(), expected)
    compare_with_global(model, reference.state_dict(), exact)
    if hot and hot_reduce != "all":  # the touched rows went through the all-gather
        assert len(sharded._hot._reduction.gathered) == 3 - (hot_reduce == "mixed")
    if report_output:
        dists = [d for d in sharded._output_dists if isinstance(d, CompactPooledEmbeddingDist)]
        return {
            "dists": len(dists),
            "sent": sum(d.elements_sent for d in dists),
            "full": sum(d.elements_full for d in dists),
        }
    return {name: s.as_dict() for name, s in cache_stats(model).items()}


class _LazyAdam:
    """The reference of a fused Adam (`torch.optim.SparseAdam`): only the rows the global batch
    touched are updated, their moments included; every other row is left as it is."""

    def __init__(self, ebc: EmbeddingBagCollection, lr: float, eps: float):
        self.ebc = ebc
        weights = [ebc.embedding_bags[name].weight for name, *_ in TABLES]
        self.adam = torch.optim.SparseAdam(weights, lr=lr, eps=eps)

    def zero_grad(self) -> None:
        self.adam.zero_grad()

    def step(self, batch: KeyedJaggedTensor) -> None:
        features = batch.to_dict()
        for name, _, _, feats in TABLES:
            weight = self.ebc.embedding_bags[name].weight
            ids = torch.cat([features[f].values() for f in feats]).unique()
            grad = weight.grad.index_select(0, ids)
            weight.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), grad, weight.shape)
        self.adam.step()


def train_with_bad_id(rank: int, world: int, bad_id: int, kind: str = "row_wise") -> None:
    """Rank 1's third batch holds `bad_id` for feature f1 (table t1, 64 rows)."""
    ebc = make_ebc()
    apply_optimizer_in_backward(torch.optim.SGD, ebc.embedding_bags.parameters(), {"lr": 0.1})
    model = shard(ebc, kind, CacheConfig(capacity=0.5))
    for step, batch in enumerate(global_batches(4, 2, world, seed=3)):
        local = local_slice(batch, rank, world)
        if rank == 1 and step == 2:
            values = local.values().clone()
            start = local.length_per_key()[0]
            values[start] = bad_id  # the first id of feature f1
            local = KeyedJaggedTensor.from_lengths_sync(FEATURES, values, local.lengths())
        loss_of(model(local)).backward()
