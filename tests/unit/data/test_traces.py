"""Tests for distcache.data.traces: Trace validation, the Zipf generator, .npz I/O, MovieLens and
trace specs. Everything runs offline except the MovieLens download, which is skipped without
network."""

from __future__ import annotations

import math
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from distcache.data import (
    Trace,
    TraceUnavailable,
    load_npz,
    movielens_trace,
    parse_trace_spec,
    save_npz,
    zipf_trace,
)
from distcache.data import traces as traces_mod
from distcache.data.traces import _coprime_multiplier, _scatter_ranks


def _trace(ids, offsets, num_rows=10, name="t") -> Trace:
    return Trace(
        ids=torch.tensor(ids, dtype=torch.int64),
        offsets=torch.tensor(offsets, dtype=torch.int64),
        num_rows=num_rows,
        name=name,
    )


# ---------------------------------------------------------------------------------------------
# Trace


def test_trace_batches_views_and_unique() -> None:
    t = _trace([3, 1, 3, 7, 0], [0, 2, 2, 5])
    assert t.num_batches == 3
    assert t.batch(0).tolist() == [3, 1]
    assert t.batch(1).numel() == 0
    assert [b.tolist() for b in t] == [[3, 1], [], [3, 7, 0]]
    assert t.batch(2).data_ptr() == t.ids[2:].data_ptr()  # a view, not a copy
    assert t.num_unique() == 4
    big = _trace([5, 999_999, 5], [0, 3], num_rows=1_000_000)  # sparse path (torch.unique)
    assert big.num_unique() == 2
    assert "num_batches=3" in repr(t)
    with pytest.raises(IndexError, match=r"\[0, 3\)"):
        t.batch(3)
    with pytest.raises(IndexError):
        t.batch(-1)


def test_trace_empty_is_valid() -> None:
    t = _trace([], [0])
    assert t.num_batches == 0 and t.num_unique() == 0 and list(t) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ids": torch.tensor([1, 2], dtype=torch.int32)}, "ids must be a 1-D torch.int64"),
        ({"ids": torch.zeros(2, 1, dtype=torch.int64)}, "ids must be a 1-D torch.int64"),
        ({"ids": [1, 2]}, "ids must be a 1-D torch.int64"),
        ({"offsets": torch.tensor([0.0, 2.0])}, "offsets must be a 1-D torch.int64"),
        ({"offsets": torch.tensor([], dtype=torch.int64)}, "batches \\+ 1 >= 1"),
        ({"offsets": torch.tensor([1, 2], dtype=torch.int64)}, "start at 0 and end at"),
        ({"offsets": torch.tensor([0, 1], dtype=torch.int64)}, "end at ids.numel\\(\\)=2"),
        ({"offsets": torch.tensor([0, 2, 1, 2], dtype=torch.int64)}, "non-decreasing"),
        ({"ids": torch.tensor([0, -1], dtype=torch.int64)}, r"\[0, num_rows=10\).*min=-1"),
        ({"ids": torch.tensor([0, 10], dtype=torch.int64)}, r"\[0, num_rows=10\).*max=10"),
        ({"num_rows": 0}, "num_rows must be >= 1"),
        ({"num_rows": True}, "num_rows must be an int"),
        ({"num_rows": 10.0}, "num_rows must be an int"),
        ({"name": None}, "name must be a str"),
    ],
)
def test_trace_validation(kwargs: dict, match: str) -> None:
    args = {
        "ids": torch.tensor([1, 2], dtype=torch.int64),
        "offsets": torch.tensor([0, 2], dtype=torch.int64),
        "num_rows": 10,
        "name": "t",
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Trace(**args)


# ---------------------------------------------------------------------------------------------
# zipf_trace


def test_zipf_shape_range_and_determinism() -> None:
    t = zipf_trace(rows=1000, alpha=1.05, batch=300, batches=7, seed=3)
    assert t.ids.dtype == torch.int64 and t.ids.shape == (2100,)
    assert t.offsets.tolist() == [300 * b for b in range(8)]
    assert 0 <= int(t.ids.min()) and int(t.ids.max()) < 1000
    assert t.name == "zipf:rows=1000,alpha=1.05,batch=300,batches=7,seed=3"
    again = zipf_trace(rows=1000, alpha=1.05, batch=300, batches=7, seed=3)
    assert torch.equal(t.ids, again.ids)
    other = zipf_trace(rows=1000, alpha=1.05, batch=300, batches=7, seed=4)
    assert not torch.equal(t.ids, other.ids)


@pytest.mark.parametrize("alpha", [0.01, 0.5, 1.0, 1.0 + 1e-12, 1.2, 3.0, 60.0])
def test_zipf_extreme_alphas_stay_in_range(alpha: float) -> None:
    t = zipf_trace(rows=5000, alpha=alpha, batch=20_000, batches=2, seed=1)
    assert 0 <= int(t.ids.min()) and int(t.ids.max()) < 5000
    if alpha >= 60:  # all mass on the top rank
        assert t.num_unique() == 1


def test_zipf_tiny_and_empty() -> None:
    assert zipf_trace(rows=1, alpha=1.0, batch=4, batches=2).ids.tolist() == [0] * 8
    empty = zipf_trace(rows=10, alpha=1.0, batch=0, batches=3)
    assert empty.ids.numel() == 0 and empty.num_batches == 3


def test_zipf_large_id_space() -> None:
    t = zipf_trace(rows=traces_mod.MAX_ZIPF_ROWS, alpha=0.8, batch=4096, batches=2)
    assert 0 <= int(t.ids.min()) and int(t.ids.max()) < traces_mod.MAX_ZIPF_ROWS


@pytest.mark.parametrize("alpha", [0.9, 1.2])
def test_zipf_follows_power_law(alpha: float) -> None:
    rows, n = 20_000, 1_000_000
    t = zipf_trace(rows=rows, alpha=alpha, batch=n // 4, batches=4, seed=11)
    rank_to_id = _scatter_ranks(torch.arange(rows), rows)  # [rows]
    counts = torch.bincount(t.ids, minlength=rows)[rank_to_id].double()  # [rows] by rank
    share = counts / n
    weights = torch.arange(1, rows + 1, dtype=torch.float64).pow(-alpha)
    expected = weights / weights.sum()
    assert math.isclose(share[0].item(), expected[0].item(), rel_tol=0.03)
    rel = share[:10] / expected[:10]
    assert bool(((rel > 0.9) & (rel < 1.1)).all()), rel
    k = np.arange(1, 201)
    slope = np.polyfit(np.log(k), np.log(share[:200].numpy()), 1)[0]
    assert abs(slope + alpha) < 0.05, slope
    # The hottest ranks are not all small ids.
    assert int(rank_to_id[:10].max()) > rows // 10


def test_rank_scatter_is_bijection() -> None:
    for rows in [*range(1, 300), 1024, 4096, 3 * 5 * 7 * 11 * 13, 2**16 + 1, 2 * 3 * 5 * 7 * 64]:
        a = _coprime_multiplier(rows)
        assert 0 <= a < max(rows, 2) and math.gcd(a, rows) == 1, rows
        ids = _scatter_ranks(torch.arange(rows), rows)
        assert torch.equal(torch.sort(ids).values, torch.arange(rows)), rows


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rows": 0}, r"rows must be an int in \[1, "),
        ({"rows": 10**10}, r"rows must be an int in \[1, "),
        ({"rows": 10.0}, "rows must be an int"),
        ({"alpha": 0.0}, "alpha must be a finite float > 0"),
        ({"alpha": -1.0}, "alpha must be a finite float > 0"),
        ({"alpha": float("nan")}, "alpha must be a finite float > 0"),
        ({"alpha": float("inf")}, "alpha must be a finite float > 0"),
        ({"batch": -1}, "batch must be an int >= 0"),
        ({"batches": 0}, "batches must be an int >= 1"),
        ({"seed": -1}, "seed must be an int in"),
    ],
)
def test_zipf_argument_errors(kwargs: dict, match: str) -> None:
    args = {"rows": 100, "alpha": 1.0, "batch": 10, "batches": 2}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        zipf_trace(**args)


# ---------------------------------------------------------------------------------------------
# .npz


def test_npz_round_trip(tmp_path: Path) -> None:
    t = zipf_trace(rows=500, alpha=1.1, batch=64, batches=5, seed=2)
    path = tmp_path / "trace.bin"  # no .npz suffix: written exactly where asked
    save_npz(t, path)
    assert path.exists()
    back = load_npz(path)
    assert torch.equal(back.ids, t.ids) and torch.equal(back.offsets, t.offsets)
    assert back.num_rows == 500 and str(path) in back.name


def test_npz_infers_num_rows_and_widens(tmp_path: Path) -> None:
    path = tmp_path / "t.npz"
    np.savez(path, ids=np.array([4, 0, 9], dtype=np.int32), offsets=np.array([0, 1, 3]))
    t = load_npz(path)
    assert t.num_rows == 10 and t.ids.dtype == torch.int64 and t.ids.tolist() == [4, 0, 9]


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        ({"ids": np.array([1, 2])}, "missing array 'offsets'"),
        ({"offsets": np.array([0])}, "missing array 'ids'"),
        ({"ids": np.array([1.0, 2.0]), "offsets": np.array([0, 2])}, "'ids' must be int64"),
        ({"ids": np.array([1, 2]), "offsets": np.array([0, 2], dtype=np.uint64)}, "int64"),
        ({"ids": np.zeros((2, 2), dtype=np.int64), "offsets": np.array([0, 4])}, "1-D"),
        ({"ids": np.array([1, 2]), "offsets": np.array([0, 3])}, "end at ids.numel"),
        ({"ids": np.array([1, 2]), "offsets": np.array([0, 2, 1, 2])}, "non-decreasing"),
        ({"ids": np.array([1, 5]), "offsets": np.array([0, 2]), "num_rows": 3}, "num_rows=3"),
        ({"ids": np.array([1]), "offsets": np.array([0, 1]), "num_rows": 2.5}, "integer scalar"),
        ({"ids": np.array([], dtype=np.int64), "offsets": np.array([0])}, "ids is empty"),
    ],
)
def test_npz_errors(tmp_path: Path, arrays: dict, match: str) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=match):
        load_npz(path)


def test_npz_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_npz(tmp_path / "missing.npz")
    junk = tmp_path / "junk.npz"
    junk.write_text("not a zip")
    with pytest.raises(ValueError, match="not a readable .npz"):
        load_npz(junk)


# ---------------------------------------------------------------------------------------------
# MovieLens


@pytest.fixture(scope="session")
def movielens() -> Trace | TraceUnavailable:
    """Downloads once per session into the default cache dir (reused by later sessions)."""
    try:
        return movielens_trace(batch=1000)
    except TraceUnavailable as err:
        return err


def test_movielens_events_items_and_order(movielens: Trace | TraceUnavailable) -> None:
    if isinstance(movielens, TraceUnavailable):
        pytest.skip(f"MovieLens-100K cannot be downloaded here: {movielens}")
    assert movielens.ids.numel() == 100_000
    assert movielens.num_rows == 1682 and movielens.num_unique() == 1682
    assert movielens.num_batches == 100 and movielens.batch(99).numel() == 1000
    # Independent re-read: events must follow the stable timestamp order.
    cache = Path.home() / ".cache" / "distcache" / "recbole"
    wheel = next(cache.glob("recbole-1.2.1-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        lines = zf.read(traces_mod._ML100K_MEMBER).decode().splitlines()[1:]
    items = np.array([int(line.split("\t")[1]) for line in lines])
    stamps = np.array([int(line.split("\t")[3]) for line in lines])
    items = items[np.argsort(stamps, kind="stable")]
    row_of = {}
    for item, row in zip(items.tolist(), movielens.ids.tolist(), strict=True):
        assert row_of.setdefault(item, row) == row  # one row per item, consistently
    assert len(set(row_of.values())) == 1682


def test_movielens_uneven_last_batch(movielens: Trace | TraceUnavailable) -> None:
    if isinstance(movielens, TraceUnavailable):
        pytest.skip(f"MovieLens-100K cannot be downloaded here: {movielens}")
    t = movielens_trace(batch=3000)  # reuses the cached wheel
    assert t.num_batches == 34 and t.batch(33).numel() == 100_000 - 33 * 3000
    assert torch.equal(t.ids, movielens.ids)


def test_movielens_download_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(cmd, **kwargs):
        assert "download" in cmd and "recbole==1.2.1" in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="Network is unreachable")

    monkeypatch.setattr(traces_mod.subprocess, "run", fail)
    with pytest.raises(TraceUnavailable, match="Network is unreachable"):
        movielens_trace(batch=10, cache_dir=tmp_path)


def test_movielens_bad_cached_wheel(tmp_path: Path) -> None:
    wheel = tmp_path / "recbole-1.2.1-py3-none-any.whl"
    wheel.write_text("truncated")
    with pytest.raises(TraceUnavailable, match="delete the file"):
        movielens_trace(batch=10, cache_dir=tmp_path)
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("recbole/__init__.py", "")
    with pytest.raises(TraceUnavailable, match="ml-100k.inter"):
        movielens_trace(batch=10, cache_dir=tmp_path)


def test_movielens_parses_inter_file(tmp_path: Path) -> None:
    wheel = tmp_path / "recbole-1.2.1-py3-none-any.whl"
    inter = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
    inter += "1\t50\t3\t30\n2\t60\t4\t10\n3\t70\t5\t30\n4\t60\t1\t20\n5\t50\t2\t10\n"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(traces_mod._ML100K_MEMBER, inter)
    t = movielens_trace(batch=2, cache_dir=tmp_path)
    # time order (stable): items 60, 50, 60, 50, 70 -> dense rows by first appearance
    assert t.ids.tolist() == [0, 1, 0, 1, 2]
    assert t.offsets.tolist() == [0, 2, 4, 5] and t.num_rows == 3


# ---------------------------------------------------------------------------------------------
# parse_trace_spec


def test_spec_zipf() -> None:
    t = parse_trace_spec("zipf:rows=1e4,alpha=1.05,batch=128,batches=3,seed=7")
    assert t.num_rows == 10_000 and t.num_batches == 3
    assert torch.equal(t.ids, zipf_trace(rows=10_000, alpha=1.05, batch=128, batches=3, seed=7).ids)
    assert torch.equal(parse_trace_spec(t.name).ids, t.ids)  # the name is itself a spec
    default_seed = parse_trace_spec(" zipf: rows=1_000, alpha=1, batch=8, batches=2 ")
    assert default_seed.name.endswith("seed=0") and default_seed.num_rows == 1000
    from_arg = parse_trace_spec("zipf:rows=100,alpha=1,batches=2", batch=16)
    assert from_arg.ids.numel() == 32
    assert parse_trace_spec("zipf:rows=100,alpha=1,batch=16,batches=2", batch=16).num_batches == 2


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("zipf:rows=100,alpha=1,batch=8", r"missing key\(s\) \['batches'\]"),
        ("zipf", r"missing key\(s\) \['rows', 'alpha', 'batch', 'batches'\]"),
        ("zipf:rows=100,alpha=1,batch=8,batches=2,skew=3", "unknown key 'skew'.*allowed keys"),
        ("zipf:rows=100,rows=100,alpha=1,batch=8,batches=2", "given twice"),
        ("zipf:rows=100,alpha,batch=8,batches=2", "expected key=value"),
        ("zipf:rows=12.5,alpha=1,batch=8,batches=2", "rows must be an integer"),
        ("zipf:rows=ten,alpha=1,batch=8,batches=2", "rows must be an integer"),
        ("zipf:rows=100,alpha=one,batch=8,batches=2", "alpha must be a float"),
        ("zipf:rows=100,alpha=-1,batch=8,batches=2", "alpha must be a finite float > 0"),
        ("uniform:rows=100", "unknown trace scheme 'uniform'.*zipf.*movielens.*npz"),
        ("trace.csv", "unknown trace scheme"),
        ("movielens", "needs a batch size"),
        ("movielens:rows=3", "unknown key 'rows'"),
    ],
)
def test_spec_errors(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_trace_spec(spec)


def test_spec_batch_conflict() -> None:
    with pytest.raises(ValueError, match="conflicts with batch=32"):
        parse_trace_spec("zipf:rows=100,alpha=1,batch=16,batches=2", batch=32)


def test_spec_npz(tmp_path: Path) -> None:
    t = zipf_trace(rows=50, alpha=1.0, batch=4, batches=3)
    save_npz(t, tmp_path / "x.npz")
    back = parse_trace_spec(str(tmp_path / "x.npz"), batch=999)  # batch ignored for files
    assert torch.equal(back.ids, t.ids) and back.num_batches == 3
    with pytest.raises(FileNotFoundError):
        parse_trace_spec(str(tmp_path / "nope.npz"))


def test_spec_movielens(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake(*, batch: int, cache_dir: Path | None = None) -> Trace:
        calls.append(batch)
        return _trace([0], [0, 1], num_rows=1)

    monkeypatch.setattr(traces_mod, "movielens_trace", fake)
    parse_trace_spec("movielens", batch=256)
    parse_trace_spec("movielens:batch=1e3")
    assert calls == [256, 1000]
