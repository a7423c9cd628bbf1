"""The job config: strict TOML, typed overrides, the resolved file, the shipped configs."""

import dataclasses
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from distcache.cache.config import CacheConfig
from distcache.errors import DistcacheConfigError
from distcache.job.check import check_inputs
from distcache.job.config import build_job_config, dump_toml, load_job_config

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.toml"))


def test_defaults_and_overrides():
    config = load_job_config(
        None, ["--cache.capacity=0.02", "--model.bottom_mlp=[32,16]", "--data.preset=tiny"]
    )
    assert config.cache.capacity == 0.02
    assert config.model.bottom_mlp == [32, 16]
    assert config.data.preset == "tiny"  # a bare word is a string


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load_and_round_trip(path):
    config = load_job_config(path)
    assert build_job_config(tomllib.loads(dump_toml(config))) == config


def test_hot_rows_round_trip_as_a_list_and_a_job_refuses_them():
    config = load_job_config(None, ["--cache.hot_rows=[3, 1]"])
    assert config.cache.hot_rows == (3, 1)
    assert build_job_config(tomllib.loads(dump_toml(config))) == config
    with pytest.raises(DistcacheConfigError, match=r"\[cache\] hot_rows = \[3, 1\] is invalid"):
        check_inputs(config)


def test_device_chosen_defaults_round_trip_left_out_or_set():
    """`staging` and `cuda_graphs` default to None (chosen per device), which TOML cannot
    write: the resolved file leaves them out, and a value set round-trips."""
    default = load_job_config(None, [])
    assert default.cache.staging is None and default.cache.cuda_graphs is None
    text = dump_toml(default)
    assert "staging" not in text and "cuda_graphs" not in text
    assert build_job_config(tomllib.loads(text)) == default
    chosen = load_job_config(None, ["--cache.staging=worker", "--cache.cuda_graphs=false"])
    assert (chosen.cache.staging, chosen.cache.cuda_graphs) == ("worker", False)
    assert build_job_config(tomllib.loads(dump_toml(chosen))) == chosen
    with pytest.raises(DistcacheConfigError, match="cuda_graphs"):
        load_job_config(None, ["--cache.cuda_graphs=1"])


def test_ints_are_accepted_as_floats():
    assert load_job_config(None, ["--cache.eps=1"]).cache.eps == 1.0


def test_capacity_means_what_it_means_in_python():
    """A float is a fraction of the rows, an int a number of rows, in a job as in Python."""
    rows = load_job_config(None, ["--cache.capacity=500"]).cache
    assert rows == CacheConfig(capacity=500) and rows.capacity_rows(10_000) == 500
    fraction = load_job_config(None, ["--cache.capacity=1.0"]).cache
    assert fraction == CacheConfig(capacity=1.0) and fraction.capacity_rows(10_000) == 10_000
    chosen = load_job_config(None, ["--cache.capacity=500"])
    assert build_job_config(tomllib.loads(dump_toml(chosen))) == chosen  # round-trips as rows
    with pytest.raises(DistcacheConfigError, match=r"\[cache\] capacity = True is invalid"):
        load_job_config(None, ["--cache.capacity=true"])


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("--cach.capacity=0.1", r"unknown config section\(s\) \['cach'\]; allowed sections"),
        ("--cache.capcity=0.1", r"unknown key\(s\) \['capcity'\] in \[cache\]; allowed keys"),
        ("--cache.capacity=0", r"\[cache\] capacity = 0 is invalid: expected an int >= 1 \(rows\)"),
        ("--cache.capacity=1.5", r"expected a fraction in \(0, 1\]"),
        ("--train.steps=2.5", r"\[train\] steps = 2.5 is invalid: expected an integer"),
        ("--train.steps=true", r"expected an integer"),
        ("--cache.prefetch_depth=65", r"prefetch_depth = 65 is invalid: expected at most"),
        ("--cache.policy=fifo", r"policy = 'fifo' is invalid: expected one of"),
        ("--cache.staging=gpu", r"staging = 'gpu' is invalid: expected one of \('worker'"),
        ("--model.bottom_mlp=[64,8]", r"ending with embedding_dim = 16"),
        ("--data.source=criteo_tsv", r"\[data\] paths = \[\] is invalid"),
        ("--plan.planner=greedy", r"one of .* or a plan .json file"),
        ("capacity=3", r"expected --section.key=value"),
        ("--model.embedding_dtype=fp8", r"embedding_dtype = 'fp8' is invalid: expected one of"),
        ("--data.on_bad_batch=ignore", r"on_bad_batch = 'ignore' is invalid: expected one of"),
        ("--train.on_nonfinite=zero", r"on_nonfinite = 'zero' is invalid: expected 'stop'"),
        ("--train.dense_learning_rate=inf", r"dense_learning_rate = inf is invalid: expected a f"),
        ("--data.preset=nope", r"preset = 'nope' is invalid: unknown synthetic preset 'nope'; al"),
        ("--data.preset=tiny:alpha=-1", r"preset = 'tiny:alpha=-1' is invalid: alpha must be in"),
        ("--model.embedding_dim=17", r"^\[model\] bottom_mlp = \[64, 16\] is invalid: [^(]*$"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(override, match):
    with pytest.raises(DistcacheConfigError, match=match):
        load_job_config(None, [override])


def test_unknown_key_in_a_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[train]\nsteps = 5\nbatchsize = 3\n")
    with pytest.raises(DistcacheConfigError, match=r"\['batchsize'\] in \[train\]"):
        load_job_config(path)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(DistcacheConfigError, match="does not exist"):
        load_job_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(DistcacheConfigError, match="not valid TOML"):
        load_job_config(bad)


def test_the_cache_section_is_the_caches_own_config():
    config = load_job_config(
        None, ["--cache.capacity=1.0", "--cache.eps=1e-6", "--cache.check_ids=false"]
    )
    assert config.cache == CacheConfig(capacity=1.0, eps=1e-6, check_ids=False)
    with pytest.raises(DistcacheConfigError, match=r"^\[cache\] eps = -1.0 is invalid: expected"):
        load_job_config(None, ["--cache.eps=-1"])
    allowed = [f.name for f in dataclasses.fields(CacheConfig)]
    with pytest.raises(DistcacheConfigError, match=re.escape(f"allowed keys: {allowed}")):
        load_job_config(None, ["--cache.size=3"])


def test_a_topology_only_with_a_planner_that_reads_one(tmp_path):
    assert load_job_config(None, ["--plan.planner=torchrec", "--plan.topology=h100"])
    with pytest.raises(DistcacheConfigError, match=r"^\[plan\] topology = 'h100' is invalid"):
        load_job_config(None, ["--plan.topology=h100"])  # planner = 'table_wise'
    bad = load_job_config(None, ["--plan.planner=distcache", f"--plan.topology={tmp_path}/x"])
    with pytest.raises(DistcacheConfigError, match=r"^\[plan\] topology .* expected a preset"):
        check_inputs(bad)
    gpu = load_job_config(None, ["--plan.planner=torchrec", "--plan.topology=h100"])
    with pytest.raises(DistcacheConfigError, match=r"^\[plan\] topology 'h100' is a cuda top"):
        check_inputs(gpu)  # [train] device = 'cpu'


def test_resume_flags() -> None:
    from distcache.job.config import parse_args

    assert not parse_args([]).checkpoint.resume
    plain = parse_args(["--resume"]).checkpoint
    assert plain.resume and not plain.require
    required = parse_args(["--resume=require"]).checkpoint
    assert required.resume and required.require
    never = parse_args(["--resume=never"]).checkpoint
    assert never.start_over and not never.resume
    with pytest.raises(DistcacheConfigError, match=r"\[checkpoint\] start_over = True is inv"):
        load_job_config(None, ["--checkpoint.resume=true", "--checkpoint.start_over=true"])


def test_weighted_features_need_synthetic_data():
    criteo = ["--data.source=criteo_tsv", '--data.paths=["day_0.tsv"]']
    with pytest.raises(DistcacheConfigError, match=r"\[data\] weighted = True is invalid"):
        load_job_config(None, [*criteo, "--data.weighted=true"])
    assert load_job_config(None, ["--data.weighted=true"]).data.weighted


def test_every_mistake_is_reported_at_once(tmp_path):
    """Unknown sections and keys, wrong types and refused values, across sections and within
    one (each refused value is named, not only the first), in one line."""
    path = tmp_path / "job.toml"
    path.write_text(
        "[cach]\nsize = 1\n[cache]\ncapcity = 0.1\npolicy = 'fifo'\n"
        "[data]\nbatch_size = 0\neval_batches = -1\n[train]\nsteps = 'ten'\n"
    )
    with pytest.raises(DistcacheConfigError) as raised:
        load_job_config(path, ["--model.embedding_dtype=fp8"])
    message = str(raised.value)
    assert "\n" not in message and message.startswith("7 mistakes: (1) unknown config section")
    for mistake in [
        "unknown config section(s) ['cach']",
        "unknown key(s) ['capcity'] in [cache]",
        "[cache] policy = 'fifo' is invalid",
        "[data] batch_size = 0 is invalid",
        "[data] eval_batches = -1 is invalid",
        "[train] steps = 'ten' is invalid: expected an integer",
        "[model] embedding_dtype = 'fp8' is invalid",
    ]:
        assert mistake in message, mistake


def test_the_inputs_mistakes_are_reported_at_once(tmp_path):
    config = load_job_config(
        None,
        [
            "--data.source=criteo_tsv",
            f'--data.paths=["{tmp_path}/a.tsv"]',
            f'--data.eval_paths=["{tmp_path}/b.tsv"]',
            f"--plan.planner={tmp_path}/plan.json",
        ],
    )
    with pytest.raises(DistcacheConfigError, match=r"^3 mistakes: \(1\) \[data\] path .*a\.tsv"):
        check_inputs(config)


def test_a_run_folder_that_cannot_be_made_is_a_mistake_before_the_job(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    for run_dir in (a_file, a_file / "run"):
        with pytest.raises(DistcacheConfigError, match=r"^\[run\] dir .* is not a writable fold"):
            check_inputs(load_job_config(None, [f"--run.dir={run_dir}"]))
    check_inputs(load_job_config(None, [f"--run.dir={tmp_path}/new/run"]))  # made by the job
    assert not (tmp_path / "new").exists()  # the check made nothing


def test_the_check_loads_no_torchrec():
    """`launch/torchrun.sh` runs the check before every launch: TorchRec's import (seconds)
    waits for the ranks. In a fresh interpreter (this one may have TorchRec loaded)."""
    root = Path(__file__).resolve().parents[3]
    code = (
        "import sys\n"
        "from distcache.__main__ import main\n"
        "assert main(['check', '--config', 'configs/tiny_cpu.toml', '--data.preset=tiny']) == 0\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torchrec', 'fbgemm_gpu'}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
