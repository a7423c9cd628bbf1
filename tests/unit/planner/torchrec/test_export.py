"""distcache plans to TorchRec sharding plans and back; a plan trained under DMP on one rank;
tables whose names TorchRec's module dict refuses (`items`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import CacheParams, ShardingEnv

from distcache import CacheConfig, DistcacheConfigError
from distcache.constants import DEFAULT_LOOKAHEAD
from distcache.planner.caches import rank_caches
from distcache.planner.shards import table_plan_terms
from distcache.planner.solver import uniform_plan
from distcache.planner.torchrec.export import (
    cache_config_for,
    from_sharding_plan,
    to_sharding_plan,
    torchrec_names,
    workload_ebc,
)
from distcache.planner.torchrec.planner import (
    torchrec_estimate,
    torchrec_module,
    torchrec_plan,
    torchrec_topology,
)
from distcache.planner.types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    DEVICE,
    HOST_CACHED,
    ROW_WISE,
    TABLE_ROW_WISE,
    TABLE_WISE,
    Plan,
    TablePlan,
    TableStats,
    Topology,
    Workload,
)
from distcache.sharding import (
    CACHED_KERNEL,
    CachedEmbeddingBagCollectionSharder,
    CachedParameterSharding,
    cache_stats,
)

WORKLOAD = Workload(
    name="small",
    tables=(
        TableStats(name="t0", rows=40, dim=8),
        TableStats(name="t1", rows=64, dim=8),
        TableStats(name="t2", rows=30, dim=4),
        TableStats(name="t3", rows=50, dim=6),
    ),
    batch_size_per_rank=4,
    optimizer="rowwise_adagrad",
)


def one_rank_plan() -> Plan:
    return Plan(
        name="hand",
        tables=(
            TablePlan(table="t0", sharding=DATA_PARALLEL, ranks=(0,)),
            TablePlan(
                table="t1",
                sharding=TABLE_WISE,
                ranks=(0,),
                storage=HOST_CACHED,
                cache_fraction=0.5,
                lookahead=2,
                prefetch_depth=1,
            ),
            TablePlan(table="t2", sharding=ROW_WISE, ranks=(0,)),
            TablePlan(
                table="t3",
                sharding=COLUMN_WISE,
                ranks=(0,),
                storage=HOST_CACHED,
                cache_fraction=0.5,
            ),
        ),
    )


def cuda_topology(world_size: int, ranks_per_node: int) -> Topology:
    return Topology(
        name="test-gpus",
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        device_memory_bytes=16 * 10**9,
        host_memory_bytes=200 * 10**9,
        device_memory_bw_bytes_per_s=3e12,
        host_to_device_bw_bytes_per_s=50e9,
        intra_node_bw_bytes_per_s=450e9,
        inter_node_bw_bytes_per_s=50e9,
        dense_flops_per_s=2e14,
    )


def test_to_sharding_plan_kernels_and_cache_configs() -> None:
    sharding_plan = to_sharding_plan(one_rank_plan(), WORKLOAD, world_size=1)
    module_plan = sharding_plan.plan[""]
    assert module_plan["t0"].sharding_type == DATA_PARALLEL
    assert module_plan["t0"].compute_kernel == "dense"
    for name in ("t1", "t3"):  # host-cached
        assert module_plan[name].compute_kernel == CACHED_KERNEL
        assert isinstance(module_plan[name], CachedParameterSharding)
    # device storage without hot rows: TorchRec's fused kernel, no cache config
    assert module_plan["t2"].compute_kernel == "fused"
    assert not isinstance(module_plan["t2"], CachedParameterSharding)
    t1 = module_plan["t1"].cache_config
    assert (t1.capacity, t1.lookahead, t1.prefetch_depth, t1.policy) == (0.5, 2, 1, "lookahead")
    assert t1.optimizer == "rowwise_adagrad"  # from the workload


def test_device_tables_on_distcache_kernel_when_asked_and_their_hot_rows() -> None:
    plan = one_rank_plan()
    module_plan = to_sharding_plan(plan, WORKLOAD, world_size=1, device_kernel=CACHED_KERNEL).plan[
        ""
    ]
    assert module_plan["t2"].compute_kernel == CACHED_KERNEL
    t2 = module_plan["t2"].cache_config
    # device: a cache of every row, staged ahead with the base config's look-ahead
    expected = (1.0, DEFAULT_LOOKAHEAD, 1, "lookahead")
    assert (t2.capacity, t2.lookahead, t2.prefetch_depth, t2.policy) == expected
    hot = dataclasses.replace(
        plan,
        tables=tuple(
            dataclasses.replace(t, hot_rows=3) if t.table == "t2" else t for t in plan.tables
        ),
    )
    module_plan = to_sharding_plan(hot, WORKLOAD, world_size=1).plan[""]
    assert module_plan["t2"].compute_kernel == "fused"  # hot rows replicated by distcache
    assert module_plan["t2"].cache_config.hot_rows == (0, 1, 2)
    assert module_plan["t2"].get_additional_fused_params() == {}  # nothing for TorchRec's kernel
    with pytest.raises(DistcacheConfigError, match="device_kernel must be"):
        to_sharding_plan(plan, WORKLOAD, world_size=1, device_kernel="fused_uvm")


def test_cache_config_keeps_base_settings_and_a_reactive_policy() -> None:
    base = CacheConfig(policy="lfu", learning_rate=0.5, optimizer="adam")
    table = TablePlan(
        table="t", sharding=TABLE_WISE, ranks=(0,), storage=HOST_CACHED, cache_fraction=0.1
    )
    config = cache_config_for(table, base)
    assert (config.policy, config.learning_rate, config.optimizer) == ("lfu", 0.5, "adam")
    ahead = cache_config_for(dataclasses.replace(table, lookahead=4, prefetch_depth=2), base)
    assert (ahead.policy, ahead.lookahead, ahead.prefetch_depth) == ("lookahead", 4, 2)


def test_round_trip_through_torchrec_form() -> None:
    plan = one_rank_plan()
    back = from_sharding_plan(
        to_sharding_plan(plan, WORKLOAD, world_size=1), WORKLOAD, world_size=1, name="hand"
    )
    assert back == plan


def test_multi_rank_placements() -> None:
    tables = (*WORKLOAD.tables[:3], TableStats(name="t3", rows=50, dim=8))
    workload = dataclasses.replace(WORKLOAD, tables=tables, optimizer="sgd")
    plan = Plan(
        name="four",
        tables=(
            TablePlan(table="t0", sharding=DATA_PARALLEL, ranks=(0, 1, 2, 3)),
            TablePlan(table="t1", sharding=ROW_WISE, ranks=(0, 1, 2, 3)),
            TablePlan(table="t2", sharding=TABLE_ROW_WISE, ranks=(2, 3)),  # node 1 of 2
            TablePlan(table="t3", sharding=COLUMN_WISE, ranks=(3, 1)),
        ),
    )
    module_plan = to_sharding_plan(
        plan, workload, world_size=4, ranks_per_node=2, device="cuda"
    ).plan[""]
    assert module_plan["t1"].sharding_type == "row_wise"
    assert module_plan["t2"].sharding_type == "table_row_wise"
    assert module_plan["t2"].compute_kernel == "fused"  # device storage
    assert [str(s.placement) for s in module_plan["t3"].sharding_spec.shards] == [
        "rank:3/cuda:1",
        "rank:1/cuda:1",
    ]
    back = from_sharding_plan(
        to_sharding_plan(plan, workload, world_size=4, ranks_per_node=2),
        workload,
        world_size=4,
        name="four",
    )
    assert back == plan


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (TablePlan(table="t1", sharding=ROW_WISE, ranks=(0, 2)), "row-wise over ranks"),
        (TablePlan(table="t1", sharding=ROW_WISE, ranks=(2, 3)), "table_row_wise over the"),
        (TablePlan(table="t1", sharding=TABLE_ROW_WISE, ranks=(0, 1, 2, 3)), "no grid"),
        (TablePlan(table="t1", sharding=TABLE_WISE, ranks=(5,)), "outside"),
        (TablePlan(table="t3", sharding=COLUMN_WISE, ranks=(0, 1, 2, 3)), "divides the dim"),
        (TablePlan(table="t3", sharding=COLUMN_WISE, ranks=(0, 0)), "distinct ranks"),
        (TablePlan(table="t1", sharding=COLUMN_WISE, ranks=(0, 1, 2, 3)), "multiples of 4"),
    ],
)
def test_inexpressible_plans_are_refused(table: TablePlan, message: str) -> None:
    others = [TablePlan(table=n, sharding=TABLE_WISE, ranks=(0,)) for n in ("t0", "t1", "t2", "t3")]
    plan = Plan(name="bad", tables=tuple(table if t.table == table.table else t for t in others))
    with pytest.raises(DistcacheConfigError, match=message):
        to_sharding_plan(plan, WORKLOAD, world_size=4, ranks_per_node=2)


def test_plan_must_cover_the_workload() -> None:
    plan = Plan(name="short", tables=(TablePlan(table="t0", sharding=TABLE_WISE, ranks=(0,)),))
    with pytest.raises(DistcacheConfigError, match=r"missing \['t1', 't2', 't3'\]"):
        to_sharding_plan(plan, WORKLOAD, world_size=1)
    bigger = dataclasses.replace(
        WORKLOAD, tables=(*WORKLOAD.tables, TableStats(name="t9", rows=5, dim=4))
    )
    sharding_plan = to_sharding_plan(one_rank_plan(), WORKLOAD, world_size=1)
    with pytest.raises(DistcacheConfigError, match=r"missing from the plan \['t9'\]"):
        from_sharding_plan(sharding_plan, bigger, world_size=1)


def test_torchrec_planner_output_converts_every_table() -> None:
    """TorchRec's own planner (CUDA topology, planned on CPU) with UVM-caching and UVM kernels
    forced on two tables: every table comes back, caches as host-cached without look-ahead."""
    workload = Workload(
        name="mixed",
        tables=tuple(TableStats(name=f"t{i}", rows=10**5 * (i + 1), dim=64) for i in range(6)),
        batch_size_per_rank=256,
    )
    topology = cuda_topology(4, 2)
    constraints = {
        "t4": ParameterConstraints(
            compute_kernels=["fused_uvm_caching"], cache_params=CacheParams(load_factor=0.1)
        ),
        "t5": ParameterConstraints(compute_kernels=["fused_uvm"]),
    }
    planner = EmbeddingShardingPlanner(
        topology=torchrec_topology(topology),
        batch_size=workload.batch_size_per_rank,
        constraints=constraints,
    )
    sharding_plan = planner.plan(torchrec_module(workload), [EmbeddingBagCollectionSharder()])
    plan = from_sharding_plan(sharding_plan, workload, world_size=4)
    assert [t.table for t in plan.tables] == [t.name for t in workload.tables]
    t4, t5 = plan.table("t4"), plan.table("t5")
    assert (t4.storage, t4.cache_fraction, t4.lookahead) == (HOST_CACHED, 0.1, 0)
    assert t5.storage == HOST_CACHED and t5.lookahead == 0 and t5.cache_fraction < 0.1
    assert all(plan.table(f"t{i}").storage == DEVICE for i in range(4))
    assert set(plan.explanations) == {t.name for t in workload.tables}


@pytest.fixture
def one_rank_group() -> Iterator[dist.ProcessGroup]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_exported_plan_trains_under_dmp(one_rank_group: dist.ProcessGroup) -> None:
    """The exported plan is what DMP + distcache's sharder take; a step updates every table."""
    torch.manual_seed(0)
    model = _one_rank_dmp(one_rank_plan(), WORKLOAD, one_rank_group)
    before = _local_weights(model)
    names = [t.name for t in WORKLOAD.tables]
    batch = KeyedJaggedTensor.from_lengths_sync(
        keys=names,
        values=torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]),
        lengths=torch.tensor([1, 2, 0, 1, 1, 1, 1, 0, 2, 0, 0, 1, 1, 1, 0, 0]),
    )
    dense = torch.optim.SGD([p for n, p in model.named_parameters() if "t0" in n], lr=0.1)
    model(batch).values().sum().backward()
    dense.step()
    after = _local_weights(model)
    assert set(before) == {f"embedding_bags.{n}.weight" for n in names}
    for key in before:
        assert not torch.equal(before[key], after[key]), key


def test_the_cost_models_caches_are_the_engines(one_rank_group: dist.ProcessGroup) -> None:
    """The caches `caches.rank_caches` prices are those DMP builds from the exported plan:
    table-wise tables of one width and look-ahead share one, whatever their capacities (its
    slots theirs together); another width, look-ahead or sharding type (another lookup) gets
    its own."""
    dims = {"a": 8, "b": 8, "c": 8, "d": 4, "e": 8, "f": 8, "g": 8, "h": 8}
    workload = Workload(
        name="caches",
        tables=tuple(TableStats(name=n, rows=64, dim=d) for n, d in dims.items()),
        batch_size_per_rank=4,
    )

    def cached(name, fraction=0.5, lookahead=2, sharding=TABLE_WISE):
        return TablePlan(table=name, sharding=sharding, ranks=(0,), storage=HOST_CACHED,
                         cache_fraction=fraction, lookahead=lookahead,
                         prefetch_depth=min(1, lookahead))  # fmt: skip

    plan = Plan(
        name="caches",
        tables=(
            cached("a"), cached("b"), cached("c"), cached("d"), cached("e", fraction=0.25),
            cached("f", lookahead=4), cached("g", lookahead=0), cached("h", sharding=ROW_WISE),
        ),
    )  # fmt: skip
    topology = cuda_topology(world_size=1, ranks_per_node=1)
    tables = plan.tables
    terms = [table_plan_terms(tp, workload.table(tp.table), workload, topology) for tp in tables]
    modelled = {frozenset(c.tables) for c in rank_caches(plan, terms, workload, topology)}
    model = _one_rank_dmp(plan, workload, one_rank_group)
    engines = {frozenset(key.split("/")[-1].split("+")) for key in cache_stats(model)}
    assert engines == modelled
    assert frozenset("abce") in engines
    slots = {frozenset(c.tables): c.slots for c in rank_caches(plan, terms, workload, topology)}
    built = {
        frozenset(k.split("/")[-1].split("+")): s.capacity for k, s in cache_stats(model).items()
    }
    assert slots == built and built[frozenset("abce")] == 3 * 32 + 16


def _one_rank_dmp(plan: Plan, workload: Workload, group: dist.ProcessGroup) -> torch.nn.Module:
    """The workload's EmbeddingBagCollection under DMP on this rank's CPU, sharded by the
    exported `plan` with distcache's sharder."""
    return DistributedModelParallel(
        workload_ebc(workload, device="cpu"),
        env=ShardingEnv.from_process_group(group),
        device=torch.device("cpu"),
        plan=to_sharding_plan(plan, workload, world_size=1),
        sharders=[CachedEmbeddingBagCollectionSharder()],
    )


def _local_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in model.state_dict().items():
        tensor = value.local_shards()[0].tensor if hasattr(value, "local_shards") else value
        out[key.removeprefix("module.")] = tensor.detach().clone()
    return out


# `items`, `keys` and `type` are attributes of `nn.ModuleDict`, which holds an EBC's tables;
# `items_` is the name `items` would take, were it free.
ODD = Workload(
    name="odd-names",
    tables=(
        TableStats(name="items", rows=40, dim=8),
        TableStats(name="users", rows=64, dim=8),
        TableStats(name="keys", rows=30, dim=4),
        TableStats(name="items_", rows=20, dim=4),
        TableStats(name="type", rows=10, dim=4),
        TableStats(name="a.b", rows=10, dim=4),
    ),
    batch_size_per_rank=4,
)


def test_tables_named_like_module_dict_attributes_get_torchrec_names() -> None:
    names = torchrec_names(ODD)
    assert names == {
        "items": "items__",
        "users": "users",
        "keys": "keys_",
        "items_": "items_",
        "type": "type_",
        "a.b": "a_b_",
    }
    ebc = workload_ebc(ODD)  # TorchRec's module dict raised KeyError on "items"
    assert [c.name for c in ebc.embedding_bag_configs()] == list(names.values())
    assert [c.feature_names for c in ebc.embedding_bag_configs()] == [[t.name] for t in ODD.tables]


def test_odd_names_round_trip_through_torchrec_form() -> None:
    plan = dataclasses.replace(uniform_plan(ODD, cuda_topology(2, 2), TABLE_WISE), name="tw")
    sharding_plan = to_sharding_plan(plan, ODD, world_size=2)
    assert set(sharding_plan.plan[""]) == set(torchrec_names(ODD).values())
    assert from_sharding_plan(sharding_plan, ODD, world_size=2, name="tw") == plan
    # A plan written with the workload's names reads too.
    module_plan = sharding_plan.plan[""]
    sharding_plan.plan[""] = {ours: module_plan[n] for ours, n in torchrec_names(ODD).items()}
    assert from_sharding_plan(sharding_plan, ODD, world_size=2, name="tw") == plan


def test_torchrec_plans_and_prices_odd_names() -> None:
    topology = cuda_topology(2, 2)
    result = torchrec_plan(ODD, topology)
    assert result.error is None
    plan = from_sharding_plan(result.plan, ODD, world_size=2)
    assert [t.table for t in plan.tables] == [t.name for t in ODD.tables]
    assert torchrec_estimate(plan, ODD, topology) > 0


def test_a_table_named_items_trains_under_dmp(one_rank_group: dist.ProcessGroup) -> None:
    workload = Workload(
        name="items-users",
        tables=(TableStats(name="items", rows=40, dim=8), TableStats(name="users", rows=30, dim=8)),
        batch_size_per_rank=2,
    )
    plan = Plan(
        name="two",
        tables=(
            TablePlan(
                table="items",
                sharding=TABLE_WISE,
                ranks=(0,),
                storage=HOST_CACHED,
                cache_fraction=0.5,
                lookahead=2,
                prefetch_depth=1,
            ),
            TablePlan(table="users", sharding=ROW_WISE, ranks=(0,)),
        ),
    )
    model = _one_rank_dmp(plan, workload, one_rank_group)
    before = _local_weights(model)
    batch = KeyedJaggedTensor.from_lengths_sync(
        keys=["items", "users"],  # features keep the tables' names
        values=torch.tensor([1, 2, 3, 4, 5]),
        lengths=torch.tensor([1, 2, 1, 1]),
    )
    model(batch).values().sum().backward()
    after = _local_weights(model)
    assert set(before) == {"embedding_bags.items_.weight", "embedding_bags.users.weight"}
    for key in before:
        assert not torch.equal(before[key], after[key]), key


MIXED = Workload(
    name="mixed",
    tables=(
        TableStats(name="bags", rows=4000, dim=8, pooling_factor=2),
        TableStats(name="clicks", rows=20000, dim=16, pooling_factor=20, pooled=False),
        TableStats(name="views", rows=5000, dim=16, pooling_factor=20, pooled=False),
    ),
    batch_size_per_rank=64,
)


def _mixed_plan() -> Plan:
    return Plan(
        name="mixed",
        tables=(
            TablePlan(table="bags", sharding=TABLE_WISE, ranks=(1,)),
            TablePlan(table="clicks", sharding=ROW_WISE, ranks=(0, 1)),
            TablePlan(
                table="views",
                sharding=COLUMN_WISE,
                ranks=(0, 1),
                storage=HOST_CACHED,
                cache_fraction=0.5,
                lookahead=4,
                prefetch_depth=1,
                hot_rows=10,
            ),
        ),
    )


def test_sequence_tables_go_to_the_embedding_collections_plan_and_back():
    """Pooled tables are planned for the EBC at `module_path`, sequence tables for the
    `EmbeddingCollection` at `sequence_module_path` (its sharder's kernels and configs), and
    the TorchRec plan reads back as the same plan."""
    plan = _mixed_plan()
    with pytest.raises(DistcacheConfigError, match="give sequence_module_path"):
        to_sharding_plan(plan, MIXED, world_size=2)
    with pytest.raises(DistcacheConfigError, match="is the EmbeddingBagCollection's module_path"):
        to_sharding_plan(plan, MIXED, world_size=2, module_path="m", sequence_module_path="m")
    sharding = to_sharding_plan(
        plan, MIXED, world_size=2, module_path="sparse.bags", sequence_module_path="sparse.seq"
    )
    assert set(sharding.plan) == {"sparse.bags", "sparse.seq"}
    assert set(sharding.plan["sparse.bags"]) == {"bags"}
    seq = sharding.plan["sparse.seq"]
    assert {n: p.sharding_type for n, p in seq.items()} == {
        "clicks": ROW_WISE,
        "views": COLUMN_WISE,
    }
    assert seq["clicks"].compute_kernel == "fused"
    views = seq["views"]
    assert views.compute_kernel == CACHED_KERNEL and isinstance(views, CachedParameterSharding)
    assert views.cache_config.hot_rows == tuple(range(10))
    assert from_sharding_plan(sharding, MIXED, world_size=2).tables == plan.tables
    only = Workload(name="seq", tables=MIXED.tables[1:], batch_size_per_rank=64)
    alone = dataclasses.replace(plan, tables=plan.tables[1:])
    assert set(to_sharding_plan(alone, only, world_size=2, module_path="ec").plan) == {"ec"}


def test_a_device_stored_sequence_table_with_hot_rows_runs_on_distcaches_kernel():
    """An `EmbeddingCollection`'s replica needs distcache's kernel: such a table is a cache of
    every row there, and reads back as device-stored."""
    plan = _mixed_plan()
    device = dataclasses.replace(plan.tables[1], hot_rows=5)
    plan = dataclasses.replace(plan, tables=(plan.tables[0], device, plan.tables[2]))
    sharding = to_sharding_plan(
        plan, MIXED, world_size=2, module_path="b", sequence_module_path="s"
    )
    clicks = sharding.plan["s"]["clicks"]
    assert clicks.compute_kernel == CACHED_KERNEL
    assert (clicks.cache_config.capacity, clicks.cache_config.hot_rows) == (1.0, tuple(range(5)))
    assert sharding.plan["b"]["bags"].compute_kernel == "fused"  # a pooled table keeps TorchRec's
    assert from_sharding_plan(sharding, MIXED, world_size=2).tables == plan.tables


def test_an_embedding_collections_tables_share_one_dim():
    odd = dataclasses.replace(
        MIXED, tables=(*MIXED.tables, TableStats(name="x", rows=9, dim=4, pooled=False))
    )
    with pytest.raises(DistcacheConfigError, match=r"sequence tables have dims \[4, 16\]"):
        torchrec_module(odd)


def test_torchrec_plans_and_prices_a_model_with_bags_and_sequences():
    """TorchRec's planner, given the EBC and the EC (each with its own sharder), places every
    table; its plan reads back, and TorchRec's estimator prices distcache's plan of the same
    workload (output per id for the sequence tables, as TorchRec's own model has it)."""
    topology = cuda_topology(2, 2)
    result = torchrec_plan(MIXED, topology)
    assert result.error is None, result.error
    assert set(result.plan.plan) == {"ebc", "ec"}
    back = from_sharding_plan(result.plan, MIXED, world_size=2)
    assert [t.table for t in back.tables] == ["bags", "clicks", "views"]
    assert result.estimate_s > 0
    plan = uniform_plan(MIXED, topology, TABLE_WISE)
    pooled = dataclasses.replace(
        MIXED, tables=tuple(dataclasses.replace(t, pooled=True) for t in MIXED.tables)
    )
    sequence_s, pooled_s = (torchrec_estimate(plan, w, topology) for w in (MIXED, pooled))
    assert sequence_s is not None and pooled_s is not None
    assert sequence_s > pooled_s  # 20 output rows a sample, not 1
    distcache = torchrec_plan(MIXED, topology, sharders="distcache")
    assert distcache.error is None, distcache.error
    kernels = {p.compute_kernel for m in distcache.plan.plan.values() for p in m.values()}
    assert kernels == {CACHED_KERNEL}
