"""`python -m distcache plan|compare`: outputs that load back, and clear errors for bad flags."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from distcache import DistcacheConfigError
from distcache.__main__ import main
from distcache.job.config import load_job_config
from distcache.planner.solver import solve
from distcache.planner.topology import preset
from distcache.planner.types import Plan
from distcache.planner.workloads import workload_preset
from distcache.sharding import CACHED_KERNEL
from distcache.tools.plan_cli import compare_main, load_workload_config, plan_main
from distcache.tools.plan_text import format_plan

SPEC = "synthetic:tables=4,rows=5000,dim=16,seed=2"
SMALL = ["--preset", SPEC, "--topology", "h100", "--world-size", "2", "--batch-size", "128"]

CONFIG = """
[model]
name = "tiny"
batch_size_per_rank = 64
optimizer = "rowwise_adagrad"
bottom_mlp = [64, 16]

[[tables]]
name = "users"
rows = 10000
dim = 16
alpha = 1.2

[[tables]]
name = "items"
rows = 500
dim = 16
pooling_factor = 3.0
"""


def test_plan_writes_json_that_loads_back_equal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    assert plan_main([*SMALL, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    loaded = Plan.load(out)
    expected = solve(workload_preset(SPEC, batch_size_per_rank=128), preset("h100", world_size=2))
    assert loaded == expected
    assert loaded.explanations == expected.explanations
    for table in expected.tables:
        assert table.table in printed
    assert "modelled step" in printed and "why:" in printed


BIG = ["--preset", "synthetic:tables=40,rows=20000,dim=16,seed=3", "--world-size", "4"]


def _reasons(printed: str) -> dict[str, str]:
    """The reasons under "why" of `plan`'s output, by table."""
    reasons: dict[str, str] = {}
    for line in printed.split("\n\nmodelled step")[0].split("\nwhy")[1].splitlines()[1:]:
        if line.startswith("  ") and not line.startswith("    "):
            name, text = line.strip().split(": ", 1)
            reasons[name] = text
        else:
            reasons[name] += " " + line.strip()
    return reasons


def test_plan_explains_the_largest_tables_of_a_big_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Beyond 32 tables, `plan` explains the 32 largest unless told (the reasons of a thousand
    tables ran to 1.85 MB), each as --explain all has it; --out holds what was explained."""
    assert plan_main([*BIG, "--explain", "all"]) == 0
    every = _reasons(capsys.readouterr().out)
    workload = workload_preset(BIG[1])
    assert list(every) == [t.name for t in workload.tables]
    out = tmp_path / "plan.json"
    assert plan_main([*BIG, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "\nwhy (32 of 40 tables; --explain all for every table" in printed
    largest = sorted(workload.tables, key=lambda t: -t.rows)[:32]
    assert set(_reasons(printed)) == {t.name for t in largest}
    assert all(every[name] == text for name, text in _reasons(printed).items())
    assert set(Plan.load(out).explanations) == {t.name for t in largest}

    assert plan_main([*BIG, "--explain", "t7, t2"]) == 0
    chosen = _reasons(capsys.readouterr().out)
    assert chosen == {"t2": every["t2"], "t7": every["t7"]}
    assert plan_main([*BIG, "--explain", "none"]) == 0
    assert "why" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("value", "named"),
    [("t1,nope", "no table named 'nope'"), ("t1,,t2", "table names separated by commas")],
)
def test_plan_refuses_a_bad_explain_before_solving(
    value: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert plan_main([*BIG, "--explain", value]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert named in captured.err.splitlines()[-1] and "--explain" in captured.err


def test_plan_writes_a_loadable_torchrec_plan(tmp_path: Path) -> None:
    out = tmp_path / "plan.pt"
    assert plan_main([*SMALL, "--torchrec-out", str(out), "--module-path", "sparse.ebc"]) == 0
    sharding_plan = torch.load(out, weights_only=False)
    shardings = sharding_plan.plan["sparse.ebc"]
    assert sorted(shardings) == ["t0", "t1", "t2", "t3"]
    assert {s.compute_kernel for s in shardings.values()} <= {CACHED_KERNEL, "dense"}


def test_plan_from_a_toml_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "model.toml"
    config.write_text(CONFIG)
    workload = load_workload_config(config)
    assert [t.name for t in workload.tables] == ["users", "items"]
    assert workload.bottom_mlp == (64, 16) and workload.table("items").pooling_factor == 3.0
    assert plan_main(["--config", str(config), "--topology", "cpu", "--world-size", "2"]) == 0
    assert "tiny on cpux2" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[model]\nlayers = 3\n[[tables]]\nname="a"\nrows=9\ndim=4\n', "unknown [model] keys"),
        ('[[tables]]\nname="a"\nrows=9\ndim=4\nwidth=2\n', "allowed: ['name', 'rows'"),
        ('[[tables]]\nname="a"\nrows=9\n', "lacks required keys ['dim']"),
        ("[model]\nname='x'\n", "at least one [[tables]]"),
        ('[dense]\n[[tables]]\nname="a"\nrows=9\ndim=4\n', "unknown top-level sections"),
        ('[[tables]]\nname="a"\nrows=0\ndim=4\n', "rows must be >= 1"),
        ("[[tables]\n", "not valid TOML"),
    ],
)
def test_config_errors_name_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(text)
    assert plan_main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "--config" in err and message in err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--preset", SPEC, "--world-size", "0"], "--world-size"),
        (["--preset", SPEC, "--device-memory", "12XB"], "--device-memory"),
        (["--preset", SPEC, "--topology", "tpu"], "--topology"),
        (["--preset", SPEC, "--topology", "missing.json"], "--topology"),
        (["--preset", "criteo-petabyte"], "--preset"),
        (["--preset", SPEC, "--config", "x.toml"], "--config"),
        (["--world-size", "2"], "--preset"),
        (["--preset", SPEC, "--bogus"], "--bogus"),
        (["--preset", SPEC, "--out", "no/such/folder/plan.json"], "--out"),
        (["--preset", SPEC, "--torchrec-out", "."], "--torchrec-out"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert plan_main(argv) == 2
    out, err = capsys.readouterr()
    assert flag in err and len(err.strip().splitlines()[-1]) < 300
    assert out == ""  # refused before planning: nothing solved, nothing printed


def test_compare_refuses_an_unwritable_json_out_before_comparing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert compare_main([*SMALL, "--no-torchrec", "--json-out", "no/such/c.json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--json-out" in err and "'no/such' of 'no/such/c.json' does not" in err


def test_a_workload_that_fits_nowhere_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--preset", "synthetic:tables=2,rows=1e6,dim=64,spread=1", "--topology", "cpu"]
    assert (
        plan_main([*argv, "--world-size", "1", "--device-memory", "1MB", "--host-memory", "1MB"])
        == 1
    )
    assert "no plan" in capsys.readouterr().err


def test_compare_json_parses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "mine.json"
    assert plan_main([*SMALL, "--out", str(mine)]) == 0
    capsys.readouterr()
    assert compare_main([*SMALL, "--json", "--plan", str(mine)]) == 0
    data = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in data["rows"]]
    assert names[:2] == ["distcache", "torchrec"] and len(names) == 5
    assert data["modelled"] is True and data["workload"] == SPEC
    assert all(r["fits"] for r in data["rows"])


def test_compare_table_without_torchrec(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", *SMALL, "--no-torchrec"]) == 0
    out = capsys.readouterr().out
    assert "not measured" in out and "torchrec " not in out and "all row-wise" in out


def test_compare_rejects_a_plan_for_another_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other.json"
    assert plan_main(["--preset", "synthetic:tables=2,rows=100,dim=8", "--out", str(other)]) == 0
    capsys.readouterr()
    assert compare_main([*SMALL, "--no-torchrec", "--plan", str(other)]) == 2
    assert f"--plan {other}" in capsys.readouterr().err
    (tmp_path / "junk.json").write_text("{not json")
    assert compare_main([*SMALL, "--plan", str(tmp_path / "junk.json")]) == 2
    assert "not a plan JSON" in capsys.readouterr().err


CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_job_config_plans_as_the_job_does(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each shipped job config plans as its header says (`plan --config configs/X.toml`)."""
    assert plan_main(["--config", str(path), "--world-size", "2"]) == 0
    workload = load_workload_config(path)
    job = load_job_config(path)
    assert workload.name == path.stem and workload.batch_size_per_rank == job.data.batch_size
    assert {t.dim for t in workload.tables} == {job.model.embedding_dim}
    if job.data.table_sizes:
        assert tuple(t.rows for t in workload.tables) == tuple(job.data.table_sizes)
    assert "modelled step" in capsys.readouterr().out


def test_a_job_config_plans_for_the_job_s_topology_unless_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The job plans on its [plan] topology, else its device's, on launch/torchrun.sh's 2
    ranks; the first line says which; --topology and --world-size still choose."""
    tiny = CONFIGS[[p.stem for p in CONFIGS].index("tiny_cpu")]
    assert plan_main(["--config", str(tiny)]) == 0
    assert capsys.readouterr().out.startswith("tiny_cpu on cpux2 (2 ranks")
    assert plan_main(["--config", str(tiny), "--topology", "h100"]) == 0
    assert capsys.readouterr().out.startswith("tiny_cpu on h100x8 (8 ranks")
    on_h200 = tmp_path / "job.toml"
    planned = 'planner = "distcache"\ntopology = "h200"'
    on_h200.write_text(tiny.read_text().replace('planner = "table_wise"', planned))
    assert plan_main(["--config", str(on_h200), "--world-size", "4"]) == 0
    assert capsys.readouterr().out.startswith("job on h200x4 (4 ranks")


def test_a_job_config_with_an_unknown_key_names_it(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text('[data]\nsource = "synthetic"\n[train]\nstepz = 3\n')
    with pytest.raises(DistcacheConfigError, match="stepz"):
        load_workload_config(config)


def test_the_plan_table_shows_hot_rows() -> None:
    workload = workload_preset(SPEC)
    plan = solve(workload, preset("h100", world_size=2))
    first = dataclasses.replace(plan.tables[0], sharding="row_wise", ranks=(0, 1), hot_rows=1234)
    hot = dataclasses.replace(plan, tables=(first, *plan.tables[1:]))
    lines = format_plan(hot, workload).splitlines()
    assert lines[0].split()[-1] == "hot"
    row = next(line for line in lines if line.startswith(first.table + " "))
    assert row.split()[-1] == "1,234"


def test_sequence_tables_from_a_toml_config_to_a_torchrec_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pooled = false` makes a table an EmbeddingCollection's: marked in the plan, and placed
    in the TorchRec plan at --sequence-module-path (which a mixed model must give)."""
    config = tmp_path / "mixed.toml"
    config.write_text(CONFIG + "pooled = false\n")  # the second table, items
    workload = load_workload_config(config)
    assert (workload.table("users").pooled, workload.table("items").pooled) == (True, False)
    base = ["--config", str(config), "--topology", "cpu", "--world-size", "2"]
    out = tmp_path / "plan.pt"
    assert plan_main([*base, "--torchrec-out", str(out)]) == 2
    assert "give sequence_module_path" in capsys.readouterr().err
    argv = [*base, "--torchrec-out", str(out), "--module-path", "ebc"]
    assert plan_main([*argv, "--sequence-module-path", "ec"]) == 0
    assert "items (seq)" in capsys.readouterr().out
    sharding_plan = torch.load(out, weights_only=False)
    assert {p: sorted(m) for p, m in sharding_plan.plan.items()} == {
        "ebc": ["users"],
        "ec": ["items_"],  # TorchRec's module dict refuses "items" (`torchrec_names`)
    }
    config.write_text(CONFIG + 'pooled = "no"\n')
    assert plan_main(base) == 2
    assert "pooled must be true or false, got 'no'" in capsys.readouterr().err


def test_compare_measure_on_cuda_without_it_is_one_line_naming_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ["--preset", SPEC, "--topology", "h100", "--world-size", "1", "--no-torchrec"]
    assert compare_main([*args, "--measure", "--device", "cuda"]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert "--device cuda: no CUDA device here" in line and "allowed here: --device cpu" in line
    assert captured.out == ""
    assert compare_main([*args, "--device", "cuda"]) == 2  # nothing to run without --measure
    assert "add --measure" in capsys.readouterr().err


def test_compare_writes_its_json_beside_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "compare.json"
    assert compare_main([*SMALL, "--no-torchrec", "--json-out", str(out)]) == 0
    assert "step ms" in capsys.readouterr().out  # the table
    assert {r["name"] for r in json.loads(out.read_text())["rows"]} >= {"distcache"}


def test_compare_prints_its_rows_when_the_json_cannot_be_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "compare.json"
    real = Path.write_text

    def full_disk(path: Path, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if path == out:
            raise OSError(28, "No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    assert compare_main([*SMALL, "--no-torchrec", "--json-out", str(out)]) == 2
    printed, err = capsys.readouterr()
    assert "step ms" in printed  # the rows, not lost
    assert f"--json-out {out}: [Errno 28] No space left on device" in err


def test_reasons_wrap_as_textwrap_does():
    """`plan`'s reasons are wrapped as `textwrap.fill` wraps them (words whole, a longer word
    on a line of its own), by a loop that takes a fraction of its time."""
    import random
    import textwrap

    from distcache.tools.plan_text import WIDTH as _WIDTH
    from distcache.tools.plan_text import wrap as _wrap

    rng = random.Random(0)
    for _ in range(200):
        words = ["x" * rng.choice([1, 3, 8, 20, _WIDTH + 5]) for _ in range(rng.randrange(0, 60))]
        text = " ".join(words)
        expected = textwrap.fill(
            text,
            width=_WIDTH,
            initial_indent="  t1: ",
            subsequent_indent="    ",
            break_long_words=False,
            break_on_hyphens=False,
        )
        assert _wrap(text, "  t1: ", "    ") == (expected or "  t1: ")
