"""Where a job's tables go: the planners' topology (`distcache.job.placement`)."""

import dataclasses

import pytest
import torch

from distcache.errors import DistcacheConfigError
from distcache.job.config import load_job_config
from distcache.job.placement import torchrec_job_topology
from distcache.planner.topology import preset
from distcache.planner.torchrec.planner import torchrec_topology

CPU = torch.device("cpu")


def test_torchrec_plans_for_the_configured_topology():
    config = load_job_config(None, ["--plan.planner=torchrec", "--plan.topology=cpu"])
    ours = torchrec_job_topology(config, 2, CPU)
    expected = torchrec_topology(preset("cpu", world_size=2))
    assert ours.world_size == 2
    assert [d.storage for d in ours.devices] == [d.storage for d in expected.devices]
    unset = load_job_config(None, ["--plan.planner=torchrec"])
    default = torchrec_job_topology(unset, 2, CPU)  # TorchRec's own
    assert [d.storage for d in default.devices] != [d.storage for d in ours.devices]


def test_each_planner_name_picks_its_plan_producer():
    """`plan_producer` is where `[plan] planner` becomes the function the job calls."""
    from distcache.job import placement

    expected = {
        "table_wise": placement.hand_plan,
        "row_wise": placement.hand_plan,
        "torchrec": placement.torchrec_job_plan,
        "distcache": placement.distcache_job_plan,
        "plans/mine.json": placement.distcache_job_plan,
    }
    assert {name: placement.plan_producer(name) for name in expected} == expected


def test_the_placement_raises_caches_too_small_for_the_batches_in_flight_and_says_so():
    from distcache import CacheConfig
    from distcache.job import dlrm
    from distcache.job.placement import describe_placement
    from distcache.sharding import CachedEmbeddingBagCollectionSharder
    from distcache.sharding.parameter_sharding import (
        attach_cache_configs,
        hold_batches_in_flight,
    )

    rows = (10, 100_000, 500)
    model = dlrm.build_dlrm(dlrm.DLRMConfig(rows=rows, dim=4), seed=0)
    config = CacheConfig(capacity=0.01, lookahead=4, prefetch_depth=1)
    sharder = CachedEmbeddingBagCollectionSharder(config)
    ebc = dlrm.embedding_bag_collection(model)
    plan = dlrm.sharding_plan(ebc, sharder, world_size=2)
    ids = {dlrm.table_name(i): 2 * 64 for i in range(len(rows))}  # 2 ranks x 64 samples
    plan, raised = hold_batches_in_flight(attach_cache_configs(plan, sharder, model), ids)
    # 2 batches in flight x 128 ids: t0 (10 rows) cached whole, t2 raised to 256 of 500 rows;
    # t1's 1 % (1,000 rows) holds them.
    assert [(s.table, s.needed_rows, s.whole) for s in raised] == [
        ("t0", 10, True),
        ("t2", 256, False),
    ]
    assert "capacity 0.01 holds 5 of its 500 rows" in raised[1].message()
    assert "Set capacity >= 256 rows" in raised[1].message()
    lines, warnings = describe_placement(plan, sharder, rows, {s.table for s in raised})
    assert len(lines) == 1 + len(rows) and warnings == []
    assert "host + cache of 10 rows (100.0%) (whole)" in lines[1]
    assert "host + cache of 1,000 rows (1.0%), L=4 K=1" in lines[2]
    assert "host + cache of 256 rows (51.2%)" in lines[3]
    # Without the raised names, a cache that is not [cache]'s is called the plan's.
    _, warnings = describe_placement(plan, sharder, rows)
    assert [w.split(":")[0] for w in warnings] == ["t0", "t2"]


def test_the_model_s_tables_take_the_configured_dtype():
    from distcache.data.sources import JobData
    from distcache.job.placement import build_model

    config = load_job_config(None, ["--model.embedding_dtype=fp16"])
    data = JobData(config.data, steps=1, rank=0, world_size=1)
    tables = [p for n, p in build_model(config, data).named_parameters() if "embedding_bags" in n]
    assert tables and {p.dtype for p in tables} == {torch.float16}
    from distcache.job.placement import job_workload

    assert {t.row_dtype_bytes for t in job_workload(config, data).tables} == {2}  # priced so


def test_the_job_names_hot_rows_only_where_its_data_knows_them():
    from distcache.data.sources import JobData
    from distcache.job.placement import _hot_rows

    synthetic = JobData(load_job_config(None, []).data, steps=1, rank=0, world_size=1)
    log_rows = synthetic._log.rows_of_ranks(1, range(4)).tolist()
    assert synthetic.hottest_rows(1, 4) == log_rows
    assert _hot_rows(synthetic, None, 1, "t1", 4) == log_rows
    criteo = load_job_config(None, ["--data.source=criteo_tsv", '--data.paths=["day_0.tsv"]'])
    data = JobData(criteo.data, steps=1, rank=0, world_size=1)
    assert data.hottest_rows(0, 4) is None
    with pytest.raises(DistcacheConfigError, match="cannot name its hottest rows without a"):
        _hot_rows(data, None, 0, "t0", 4)


def _criteo_job(tmp_path, *overrides):
    """A Criteo TSV job whose table t0 reads category 'aa' in half its lines, 'bb' in a
    quarter, and a fresh one in the rest; every other table one category."""
    from distcache.data.sources import JobData

    lines = []
    for i in range(64):
        first = "aa" if i % 2 == 0 else "bb" if i % 4 == 1 else f"c{i:x}"
        cats = [first] + ["1a"] * 25
        lines.append("\t".join(["1", *[str(i)] * 13, *cats]) + "\n")
    path = tmp_path / "day_0.tsv"
    path.write_text("".join(lines))
    config = load_job_config(
        None,
        [
            "--data.source=criteo_tsv",
            f'--data.paths=["{path}"]',
            "--data.table_sizes=[" + ",".join(["1000"] * 26) + "]",
            "--data.batch_size=8",
            *overrides,
        ],
    )
    return config, JobData(config.data, steps=8, rank=0, world_size=1)


def _plan_file(tmp_path, hot_rows):
    from distcache.planner.types import TABLE_WISE, Plan, TablePlan

    tables = tuple(
        TablePlan(table=f"t{i}", sharding=TABLE_WISE, ranks=(0,), hot_rows=hot_rows * (i == 0))
        for i in range(26)
    )
    path = tmp_path / "plan.json"
    Plan(name="file", tables=tables).save(path)
    return str(path)


def test_a_criteo_job_replicates_the_rows_its_sample_counts_most(tmp_path):
    """Rank 0 counts the first `[plan] sample_batches` batches: the plan's hot rows of t0 are
    the two categories most read there (the reader's own rows, counted here as reference);
    too few sampled rows, or no sample, is a clear error."""
    from collections import Counter

    from distcache.job.placement import job_workload, plan_on_rank_zero

    plan = _plan_file(tmp_path, 2)
    config, data = _criteo_job(tmp_path, f"--plan.planner={plan}", "--plan.sample_batches=4")
    first = [b.sparse_features["f0"].values().tolist() for b in list(data.train_batches())[:4]]
    counted = Counter(r for rows in first for r in rows).most_common(3)
    assert counted[1][1] > counted[2][1]  # 'aa' and 'bb' lead
    _, hot = plan_on_rank_zero(config, data, job_workload(config, data), 1)
    assert hot == {"t0": sorted([counted[0][0], counted[1][0]])}
    config, data = _criteo_job(tmp_path, f"--plan.planner={_plan_file(tmp_path, 40)}")
    with pytest.raises(DistcacheConfigError, match="saw 18 of its rows; sample more"):
        plan_on_rank_zero(config, data, job_workload(config, data), 1)
    config, data = _criteo_job(tmp_path, f"--plan.planner={plan}", "--plan.sample_batches=0")
    with pytest.raises(DistcacheConfigError, match="without a sample"):
        plan_on_rank_zero(config, data, job_workload(config, data), 1)
    from distcache.planner.types import Plan

    extra = Plan.load(plan)
    extra = Plan(
        name="extra", tables=(*extra.tables, dataclasses.replace(extra.tables[1], table="t26"))
    )
    extra.save(tmp_path / "extra.json")
    config, data = _criteo_job(tmp_path, f"--plan.planner={tmp_path / 'extra.json'}")
    with pytest.raises(DistcacheConfigError, match="tables \\['t26'\\] that the job does not"):
        plan_on_rank_zero(config, data, job_workload(config, data), 1)


def test_the_distcache_planner_prices_a_criteo_job_from_its_sample(tmp_path):
    """The tables' power laws are fitted to the sample: t0 (a long tail of categories) flatter
    than a table that read one category; no sample: the default exponent for every table."""
    from distcache.job.placement import job_workload, sampled_workload

    config, data = _criteo_job(tmp_path, "--plan.planner=distcache", "--plan.sample_batches=8")
    workload, counts = sampled_workload(config, data, job_workload(config, data))
    assert [c.lookups for c in counts] == [64] * 26
    assert counts[0].seen == 18 and counts[1].seen == 1
    alphas = [t.alpha for t in workload.tables]
    assert alphas[0] < 2.0 < alphas[1] and len(set(alphas[1:])) == 1
    none, _ = _criteo_job(tmp_path, "--plan.sample_batches=0")
    assert sampled_workload(none, data, job_workload(none, data)) is None
