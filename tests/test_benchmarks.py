"""Smoke runs of the benchmarks: tiny sizes, in a subprocess, JSON checked."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(script: str, *argv: str, timeout: int) -> subprocess.CompletedProcess:
    """benchmarks/`script` run with `argv` from the project root; it must succeed (the tails of
    its output otherwise)."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *argv],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run


@pytest.mark.timeout(120)
def test_throughput_smoke(tmp_path):
    out = tmp_path / "throughput.json"
    # (at / 1000 the big tables' caches do not hold every row: lru and sync miss)
    argv = [
        "--ranks", "1", "--steps", "3", "--warmup", "1", "--scale", "1000", "--batch", "64",
        "--capacities", "0.05", "--lru-capacities", "0.05", "--lookahead", "2",
        "--sync-capacities", "0.05", "--hook-capacities", "0.05",
        "--threads", "1", "--timeout", "100", "--json", str(out), "--phases",
    ]  # fmt: skip
    run = _bench("throughput.py", *argv, timeout=110)
    assert "0 critical-path misses" in run.stdout
    payload = json.loads(out.read_text())
    assert payload["config"]["ranks"] == 1 and payload["config"]["lookahead"] == 2
    assert len(payload["config"]["rows"]) == 26
    assert "processor" in payload["machine"]
    summary = payload["results"][0]["summary"]
    assert [(r["variant"], r["capacity"]) for r in summary] == [
        ("distcache", 0.05),
        ("lru", 0.05),
        ("sync", 0.05),
        ("prefetch_hook", 0.05),
        ("torchrec", None),
    ]
    for row in summary:
        assert row["steps_per_s"] > 0 and row["samples_per_s"] == pytest.approx(
            row["steps_per_s"] * 64
        )
        if row["variant"] != "torchrec":
            assert 0 <= row["hit_rate"] <= 1 and row["loads_per_step"] >= 0
            assert 0 <= row["wait_fraction"] < 1
    assert all(r["critical_misses"] == 0 for r in summary if r["variant"] == "distcache")
    # Reactive engines stage at lookup; TorchRec's prefetch hook stages the next batch ahead.
    by_variant = {r["variant"]: r for r in summary}
    assert by_variant["lru"]["critical_misses"] > 0 and by_variant["sync"]["critical_misses"] > 0
    assert by_variant["prefetch_hook"]["critical_misses"] == 0
    assert summary[-1]["x_torchrec"] == 1.0
    for row in summary:  # the ratio's paired-bootstrap interval holds the ratio itself
        assert row["x_torchrec_low"] <= row["x_torchrec"] + 1e-12 <= row["x_torchrec_high"] + 2e-12
    assert "90 % interval" in run.stdout
    per_rank = payload["results"][0]["per_rank"]
    assert len(per_rank) == 1 and len(per_rank[0][0]["step_s"]) == 3
    # --phases: each variant's timed steps by phase, the pipelines' own stages where they ran.
    phases = {v["variant"]: v["phases"] for v in per_rank[0]}
    for name, found in phases.items():
        assert found["step"]["calls"] == 1 and found["backward"]["calls"] == 1, name
        assert 0 < found["backward"]["wall_ms"] < found["step"]["wall_ms"], name
    assert "distcache: route finish" in phases["distcache"]
    assert "engine: stage" in phases["prefetch_hook"]  # (sync stages inside its lookup)
    assert "torchrec: wait_sparse_data_dist" in phases["torchrec"]
    assert not any(p.startswith(("distcache:", "engine:")) for p in phases["torchrec"])
    assert "per phase, ms a step" in run.stdout


@pytest.mark.timeout(120)
def test_engine_throughput_smoke(tmp_path):
    out = tmp_path / "engine.json"
    _bench("engine_throughput.py", "--quick", "--json", str(out), timeout=110)
    payload = json.loads(out.read_text())
    assert payload["commit"] and "processor" in payload["machine"]
    assert len(payload["source_sha256"]) == 16
    rows = {(r["bench"], r["variant"]): r for r in payload["results"]}
    for la in (8, 64, 256):
        assert rows["scheduler", f"lookahead L={la}"]["ids_per_s"] > 0
    fwd = [r for r in payload["results"] if r["bench"] == "fwd+bwd"]
    assert fwd[0]["variant"] == "nn.EmbeddingBag" and fwd[0]["x_embedding_bag"] == 1.0
    assert all(r["critical_misses"] == 0 for r in fwd if r["variant"].startswith("distcache"))
    # Measured, not assumed: look-ahead keeps 8 bytes per row (int32 slot map and window
    # position), LRU the same, LFU 4 more (its per-row use counts).
    per_row = {r["variant"]: r["bytes_per_row"] for r in payload["results"]
               if r["bench"] == "device bytes"}  # fmt: skip
    assert per_row == {"lookahead": 8.0, "lru": 8.0, "lfu": 12.0}
    host = {r["variant"]: r["ms_per_step"] for r in payload["results"] if r["bench"] == "host"}
    assert set(host) == {
        "nn.EmbeddingBag",
        "distcache 1",
        "distcache 0.05",
        "distcache 0.05 graphs",
        "distcache 0.05 graphs direct",
        "lru 0.05",
    }
    assert all(ms > 0 for ms in host.values())
    capacity = [r for r in payload["results"] if r["bench"] == "capacity"]
    assert [r["variant"] for r in capacity] == ["1 %", "5 %", "20 %"]
    assert all(r["evictions_per_batch"] > 0 and r["x_fastest"] >= 1.0 for r in capacity)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.timeout(120)
def test_engine_throughput_times_the_fused_scheduler(tmp_path):
    """--fused: the scheduler's sections with `CacheConfig.fused` (Triton's interpreter here),
    each cache full and evicting."""
    out = tmp_path / "fused.json"
    _bench(
        "engine_throughput.py", "--quick", "--fused", "--skip", "fwd,bytes,ops,host",
        "--rounds", "1", "--json", str(out), timeout=110,
    )  # fmt: skip
    payload = json.loads(out.read_text())
    assert payload["config"]["fused"] is True
    capacity = [r for r in payload["results"] if r["bench"] == "capacity"]
    assert [r["variant"] for r in capacity] == ["1 %", "5 %", "20 %"]
    assert all(r["evictions_per_batch"] > 0 for r in capacity)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "kind",
    [
        [
            "--tables",
            "2",
            "--rows",
            "5000",
            "--dim",
            "128",
            "--pooling",
            "20",
            "--batch-size",
            "64",
        ],
        ["--pooled", "--tables", "2", "--rows", "5000", "--dim", "256", "--batch-size", "512"],
    ],
    ids=["sequence", "pooled"],
)
def test_hot_rows_smoke(tmp_path, kind):
    """Small sizes: distcache's plan replicates hot rows, all three plans run on 2 ranks, the
    all-to-all bytes are the model's (but for TorchRec's lengths, and the sampled share of
    cold ids), an all-gather of touched rows is counted apart, where a replica has one."""
    out = tmp_path / "hot.json"
    argv = [*kind, "--pooling", "1"] if "--pooled" in kind else kind
    argv += ["--rounds", "1", "--steps", "2", "--warmup", "1"]
    _bench("hot_rows.py", *argv, "--json", str(out), timeout=140)
    payload = json.loads(out.read_text())
    *rows, summary = payload["results"]
    assert [r["plan"] for r in rows] == ["distcache", "distcache without hot rows", "torchrec"]
    assert rows[0]["hot_rows"] > 0 and rows[1]["hot_rows"] == 0
    for row in rows:
        assert row["step_ms"] > 0
        assert (row["hot_gather_kb"] > 0) == ("touched" in row["hot_reduce"]), row
    batch = int(kind[kind.index("--batch-size") + 1])
    lengths_kb = 8 * 2 * batch / 1e3 + 0.064  # at most 8 bytes a bag and 64 a step
    for row in rows[1:]:  # every id routed: the bytes are the model's
        assert row["modelled_a2a_kb"] <= row["a2a_kb"] <= row["modelled_a2a_kb"] + lengths_kb
    # With replicas the cold ids are a sample's: about the model's expected share.
    assert rows[0]["a2a_kb"] == pytest.approx(rows[0]["modelled_a2a_kb"], rel=0.1)
    assert rows[0]["a2a_kb"] < rows[1]["a2a_kb"]
    assert set(summary["summary"]) == {"hot_over_none", "distcache_over_torchrec"}


def test_source_digest_names_the_code_not_the_results(tmp_path):
    """`source_sha256` of a result: the same for the same code, whatever else changed."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _common import source_digest
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    (tmp_path / "distcache" / "cache").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    code = tmp_path / "distcache" / "cache" / "engine.py"
    code.write_text("x = 1\n")
    first = source_digest(tmp_path)
    (tmp_path / "benchmarks" / "results" / "r.json").write_text("{}")
    (tmp_path / "README.md").write_text("results")
    assert source_digest(tmp_path) == first
    code.write_text("x = 2\n")
    assert source_digest(tmp_path) != first
    code.write_text("x = 1\n")
    (tmp_path / "benchmarks" / "new.py").write_text("")
    assert source_digest(tmp_path) != first


def _headline(tmp_path, *extra: str) -> list[dict]:
    """gpu_headline.py on CPU at a tiny scale with `extra` arguments: its results."""
    out = tmp_path / "headline.json"
    argv = [
        "--device", "cpu", "--scale", "4000", "--batch", "64", "--steps", "3", "--warmup", "1",
        "--max-warmup", "40", "--capacities", "0.05", "--lru-capacities", "0.05",
        "--profile-steps", "0", "--json", str(out), *extra,
    ]  # fmt: skip
    _bench("gpu_headline.py", *argv, timeout=200)
    return json.loads(out.read_text())["results"]


@pytest.mark.timeout(240)
def test_gpu_headline_on_cpu_and_the_planner_against_it(tmp_path):
    """gpu_headline.py's variants at a tiny scale on CPU (the quick GPU stage's command), then
    planner_vs_gpu.py on its results: each measured variant priced, loads modelled both ways.
    FBGEMM's TBE with every row in memory (its CPU kernels) trains as nn.EmbeddingBag and
    distcache do, from the same rows: the same losses; its UVM caches skip, CUDA only."""
    fbgemm = importlib.util.find_spec("fbgemm_gpu") is not None
    variants = "fbgemm_device,fbgemm_uvm,fbgemm_uvm_prefetch,device,distcache"
    results = _headline(tmp_path, "--variants", f"{variants},distcache_worker,distcache_eager,lru")
    by_name = {r["variant"]: r for r in results}
    measured = {r["variant"] for r in results if "samples_per_s" in r}
    assert measured == {"device", "distcache", "distcache_worker", "distcache_eager", "lru"} | (
        {"fbgemm_device"} if fbgemm else set()
    )
    for name in ("fbgemm_uvm", "fbgemm_uvm_prefetch"):
        assert "CUDA only" in by_name[name]["skipped"] or not fbgemm
    if fbgemm:
        assert by_name["fbgemm_device"]["x_fbgemm_device"] == 1.0
        assert by_name["device"]["x_fbgemm_device"] > 0 and by_name["device"]["x_device"] == 1.0
        for name in ("device", "distcache", "lru"):  # against fbgemm_device's losses
            assert by_name[name]["loss_max_diff"] < 1e-5, name
    headline, compared = tmp_path / "headline.json", tmp_path / "planner.json"
    _bench("planner_vs_gpu.py", str(headline), "--json", str(compared), timeout=200)
    rows = {r["variant"]: r for r in json.loads(compared.read_text())["results"]}
    assert rows.keys() == measured
    for name in ("distcache", "distcache_worker", "distcache_eager"):
        row = rows[name]
        assert row["measured_loads"] >= 0 and row["loads_shared_cache"] >= 0
        assert row["loads_per_table_caches"] >= row["loads_shared_cache"]  # sharing never loses
    assert rows["device"]["modelled_x_device"] == 1.0
    # The same run's loads counted again by planner_loads.py on its own batches: the same count
    # (the replay draws the batches as gpu_headline.Data does).
    replayed = tmp_path / "replayed.json"
    _bench("planner_loads.py", "--replay", str(headline), "--json", str(replayed), timeout=100)
    (row,) = json.loads(replayed.read_text())["results"]
    assert (
        row["capacity"] == 0.05 and row["measured_loads"] == by_name["distcache"]["loads_per_step"]
    )
    assert row["replayed_loads"] == pytest.approx(row["measured_loads"], rel=1e-12)


@pytest.mark.timeout(240)
def test_gpu_headline_rowwise_adagrad_on_cpu(tmp_path):
    """--optimizer rowwise_adagrad: distcache's row-wise Adagrad and FBGEMM's
    EXACT_ROWWISE_ADAGRAD (its CPU kernels) give the same losses over a dozen steps;
    nn.EmbeddingBag, which has none, skips with the reason."""
    fbgemm = importlib.util.find_spec("fbgemm_gpu") is not None
    results = _headline(
        tmp_path, "--optimizer", "rowwise_adagrad", "--warmup", "10",
        "--variants", "fbgemm_device,distcache,lru,device", "--cprofile", "5",
    )  # fmt: skip
    by_name = {r["variant"]: r for r in results}
    assert "rowwise_adagrad" in by_name["device"]["skipped"]
    assert by_name["distcache"]["critical_misses"] == 0
    # Where the host's time goes: each phase's, and (--cprofile) the functions of most.
    host, functions = (
        by_name["distcache"]["host_ms_per_step"],
        by_name["distcache"]["host_functions"],
    )
    assert set(host) == {"enqueue", "stage", "forward", "dense", "backward"}
    assert sum(host.values()) <= by_name["distcache"]["step_ms"] * 1.05
    assert functions[0]["function"].startswith("(distcache") and functions[0]["own_ms"] > 0
    assert len(functions) == 6 and all(f["calls"] > 0 for f in functions[1:])
    # The profiled steps come after the timed ones and leave their figures alone (the losses
    # differ: the batches' dense features and labels are drawn for every step of a run).
    (plain,) = _headline(
        tmp_path, "--optimizer", "rowwise_adagrad", "--warmup", "10", "--variants", "distcache"
    )
    for key in ("loads_per_step", "writebacks_per_step", "hit_rate"):
        assert plain[key] == by_name["distcache"][key], key
    if not fbgemm:
        assert "fbgemm_gpu" in by_name["fbgemm_device"]["skipped"]
        return
    assert len(by_name["fbgemm_device"]["losses"]) == 13
    for name in ("distcache", "lru"):
        assert by_name[name]["loss_max_diff"] < 1e-5, name


def test_throughput_offers_torchrecs_uvm_cache_on_cuda_only():
    """`--uvm-capacities` (TorchRec's fused_uvm_caching under its two pipelines) and
    `--torchrec-prefetch-capacities` are refused on CPU with what they need; the lines that
    compare distcache with the faster of the two, and under TorchRec's prefetch pipeline."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import throughput
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert throughput.parse_args(["--device", "cpu"]).uvm_capacities == []
    assert throughput.parse_args(["--fused"]).fused and not throughput.parse_args([]).fused
    for flag in ("--uvm-capacities", "--torchrec-prefetch-capacities"):
        with pytest.raises(SystemExit):
            throughput.parse_args(["--device", "cpu", flag, "0.05"])
    summary = [
        {"variant": "distcache", "capacity": 0.02, "cap": "2 %", "steps_per_s": 30.0,
         "x_torchrec": 0.9},
        {"variant": "distcache_torchrec_prefetch", "capacity": 0.02, "cap": "2 %",
         "steps_per_s": 18.0, "x_torchrec": 0.54},
        {"variant": "torchrec_uvm", "capacity": 0.02, "steps_per_s": 20.0},
        {"variant": "torchrec_uvm_prefetch", "capacity": 0.02, "steps_per_s": 24.0},
        {"variant": "torchrec_uvm", "capacity": 0.05, "steps_per_s": 99.0},
    ]  # fmt: skip
    assert throughput.against_uvm(summary) == [
        "distcache at 2 %: 1.25 x torchrec_uvm_prefetch (the faster of TorchRec's UVM cache's "
        "two pipelines), 0.90 x torchrec",
        "distcache_torchrec_prefetch at 2 %: 0.75 x torchrec_uvm_prefetch (the same pipeline "
        "over FBGEMM's UVM cache), 0.54 x torchrec",
    ]


@pytest.mark.timeout(120)
def test_cache_policies_steady_state_and_the_planners_model(tmp_path):
    """cache_policies.py counts from --steady-after on and, on a zipf trace, adds the planner's
    loads per batch (`--model`): on a cache the warm-up fills, LRU's steady loads are close to
    Che's approximation, and every policy loads at least Belady's optimum."""
    out = tmp_path / "policies.json"
    argv = [
        "--trace", "zipf:rows=2e5,alpha=1.05,batch=4000,batches=160", "--capacity", "20000",
        "--policies", "optimal,lookahead,lru", "--lookahead", "16", "--steady-after", "100",
        "--model", "--json", str(out),
    ]  # fmt: skip
    _bench("cache_policies.py", *argv, timeout=110)
    rows = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"optimal", "lookahead L=16 K=1", "lru", "model: frequency", "model: lru"}
    assert all(rows[p]["batches"] == 60 for p in ("optimal", "lookahead L=16 K=1", "lru"))
    assert rows["lru"]["loads_per_batch"] == pytest.approx(
        rows["model: lru"]["loads_per_batch"], rel=0.05
    )
    assert rows["optimal"]["loads"] <= rows["lookahead L=16 K=1"]["loads"] <= rows["lru"]["loads"]


@pytest.mark.timeout(120)
def test_planner_loads_against_the_engine(tmp_path):
    """planner_loads.py on Kaggle's tables / 200: after a first window the engine's LRU cache
    loads what the planner's 'lru' model says within 5 % (it was within 1 %), and its
    look-ahead cache within 15 % of the 'frequency' model (it loaded 0.91 x)."""
    out = tmp_path / "loads.json"
    _bench(
        "planner_loads.py", "--tables", "kaggle", "--scale", "200", "--batch", "256",
        "--steps", "600", "--window", "200", "--capacities", "0.1", "--json", str(out),
        timeout=100,
    )  # fmt: skip
    rows = json.loads(out.read_text())["results"]
    assert [(r["policy"], r["steps_from"]) for r in rows] == [
        (p, s) for p in ("lookahead", "lru") for s in (0, 200, 400)
    ]
    for r in rows:
        if r["steps_from"] > 0:
            tolerance = 0.05 if r["policy"] == "lru" else 0.15
            assert r["engine_x_model"] == pytest.approx(1.0, abs=tolerance), r


def test_phase_timers_count_each_phase_once_and_put_methods_back():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import phases
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    class Base:
        def inherited(self, n: int) -> int:
            return n if n <= 0 else self.inherited(n - 1)  # recursive: counted once a call

    class Model(Base):
        def own(self) -> int:
            return self.inherited(3)

    here = __name__
    timers = phases.PhaseTimers(
        {"step": "", "own": f"{here}:Model.own", "inherited": f"{here}:Model.inherited",
         "missing": f"{here}:Nowhere.method"}
    )  # fmt: skip
    globals()["Model"] = Model
    try:
        own = Model.own
        timers.install()
        model = Model()
        model.own()  # outside a step: not counted
        for _ in range(2):
            with timers.step(0):
                model.own()
        found = timers.per_step(0)
        assert set(found) == {"step", "own", "inherited"}
        assert found["own"]["calls"] == 1 and found["inherited"]["calls"] == 1
        assert 0 <= found["inherited"]["wall_ms"] <= found["own"]["wall_ms"]
        assert found["own"]["wall_ms"] <= found["step"]["wall_ms"]
        timers.uninstall()
        assert Model.own is own and "inherited" not in vars(Model)
    finally:
        del globals()["Model"]


@pytest.mark.timeout(180)
def test_host_overlap_runs_the_side_work_in_each_mode(tmp_path):
    """host_overlap.py: the training step alone, and beside a cache's scheduling inline, on a
    thread and in spawned processes (its cache on the run's device, and on the CPU), each
    mode's side work done once per timed step (none alone)."""
    out = tmp_path / "overlap.json"
    argv = [
        "--device", "cpu", "--scale", "5000", "--capacity", "0.3", "--batch", "16", "--dim", "8",
        "--lookahead", "4", "--warmup", "3", "--steps", "5", "--rounds", "2",
        "--threads", "1", "--json", str(out),
    ]  # fmt: skip
    run = _bench("host_overlap.py", *argv, timeout=170)
    assert "x alone" in run.stdout
    results = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert list(results) == ["alone", "inline", "thread", "process", "process_cpu"]
    assert results["alone"]["x_alone"] == 1.0 and results["alone"]["side_steps"] == 0
    assert results["alone"]["side_host_ms"] is None
    for mode in ("inline", "thread", "process", "process_cpu"):
        assert results[mode]["side_steps"] == 2 * 5, mode
        assert results[mode]["side_host_ms"] > 0, mode
        assert len(results[mode]["rounds"]) == 2 and results[mode]["steps_per_s"] > 0


@pytest.mark.timeout(200)
def test_planner_speed_times_the_stages_and_a_base_in_turns(tmp_path):
    """planner_speed.py: fresh `plan` processes of this tree and of a base commit (HEAD's
    distcache/, unpacked), in turns; the solver's stages read from its log, the outputs' md5
    equal (the same code plans alike), and the machine's reference workload timed."""
    out = tmp_path / "speed.json"
    argv = ["--plan-args", "--preset synthetic:tables=6 --world-size 4", "--runs", "2"]
    run = _bench("planner_speed.py", *argv, "--base", "HEAD", "--json", str(out), timeout=170)
    assert "reference workload" in run.stdout
    data = json.loads(out.read_text())
    head, base = data["results"]
    assert (head["variant"], base["variant"], head["runs"], base["runs"]) == ("head", "base", 2, 2)
    assert head["same_output_as_base"] and len(head["md5"]) == 1
    assert len(head["x_base_pairs"]) == 2 and head["x_base_median"] > 0
    for row in (head, base):
        stages = row["all"][0]["stages_s"]
        assert list(stages) == ["menus", "starts", "search", "hot_rows", "explain"]
        assert 0 < row["all"][0]["solve_s"] < row["min_s"] <= row["median_s"]
    assert (
        data["config"]["reference"]["python_s"] > 0 and data["config"]["reference"]["numpy_s"] > 0
    )
    assert data["config"]["bytecode"] == "cached"


def test_planner_speed_runs_read_the_bytecode_their_first_run_wrote(tmp_path, monkeypatch):
    """planner_speed.py's default: a run given a bytecode folder writes distcache's bytecode
    there even where the shell forbids writing it (PYTHONDONTWRITEBYTECODE), and the next runs
    read it there: a valid one is loaded, not compiled again (which would write it anew), and
    a spoilt one is written anew."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import planner_speed
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    args, pycache = ["--preset", "synthetic:tables=3", "--world-size", "2"], tmp_path / "pyc"
    first = planner_speed.run_plan(args, ROOT, pycache)
    (compiled,) = pycache.rglob("distcache/planner/solver.*.pyc")
    written = compiled.stat().st_mtime_ns
    again = planner_speed.run_plan(args, ROOT, pycache)
    assert again["md5"] == first["md5"] and compiled.stat().st_mtime_ns == written
    compiled.write_bytes(b"")  # spoilt: a run that reads this folder compiles and writes it anew
    planner_speed.run_plan(args, ROOT, pycache)
    assert compiled.stat().st_size > 0
