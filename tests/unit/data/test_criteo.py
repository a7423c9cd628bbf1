"""Criteo readers: the raw TSV reader (real sample and handmade files) and the .npy reader."""

from pathlib import Path

import numpy as np
import pytest
import torch

from distcache.data.criteo import (
    CRITEO_KAGGLE_TABLE_SIZES,
    CriteoFormatError,
    CriteoNpyReader,
    CriteoTsvReader,
)
from distcache.errors import DistcacheConfigError

TINY = Path(__file__).resolve().parents[3].parent / "shared/data/criteo_tiny/train.tiny.tsv"
SIZES = (7,) * 26


def _line(label="1", ints=None, cats=None) -> str:
    ints = [str(i) for i in range(13)] if ints is None else ints
    cats = ["1a"] * 26 if cats is None else cats
    return "\t".join([label, *ints, *cats]) + "\n"


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(lines))
    return path


def _numbered(path: Path, n: int, first: int = 0) -> Path:
    """n lines whose I1 is the line's global number (first, first + 1, ...)."""
    return _write(path, [_line(str(i % 2), [str(first + i)] + ["0"] * 12) for i in range(n)])


def _read_all(reader) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    batches = list(reader)
    dense = np.concatenate([b.dense_features.numpy() for b in batches])
    ids = np.concatenate([b.sparse_features.values().view(26, -1).T.numpy() for b in batches])
    labels = np.concatenate([b.labels.numpy() for b in batches])
    return dense, ids, labels


@pytest.mark.skipif(not TINY.exists(), reason=f"Criteo sample not present at {TINY}")
def test_reads_the_criteo_sample():
    reader = CriteoTsvReader(TINY, table_sizes=CRITEO_KAGGLE_TABLE_SIZES, batch_size=512)
    batches = list(reader)
    assert [len(b.labels) for b in batches] == [512, 512, 512, 463]  # 1,999 lines
    for b in batches:
        size = len(b.labels)
        assert b.dense_features.shape == (size, 13) and b.dense_features.dtype == torch.float32
        assert set(b.labels.unique().tolist()) <= {0.0, 1.0}
        kjt = b.sparse_features
        assert kjt.stride() == size and torch.equal(
            kjt.lengths(), torch.ones(26 * size, dtype=torch.int32)
        )
        for key, rows in zip(kjt.keys(), CRITEO_KAGGLE_TABLE_SIZES, strict=True):
            assert int(kjt[key].values().max()) < rows
    assert int(batches[0].sparse_features["f0"].values()[0]) == 0x68FD1E64 % 1460
    dropped = CriteoTsvReader(
        TINY, table_sizes=CRITEO_KAGGLE_TABLE_SIZES, batch_size=512, drop_last=True
    )
    assert len(list(dropped)) == 3


def test_empty_cells_and_negative_ints(tmp_path):
    ints = ["", "-3", "0", "1", "2", "", "10", "", "", "", "", "", "7"]
    cats = ["", "a", "FF", "00000010", "deadbeef", *["1a"] * 21]
    path = _write(tmp_path / "edge.tsv", [_line("0", ints, cats), _line("", ints, cats)])
    dense, ids, labels = _read_all(CriteoTsvReader(path, table_sizes=(1000,) * 26, batch_size=4))
    expected = np.log1p(np.maximum([int(x or 0) for x in ints], 0)).astype(np.float32)
    np.testing.assert_allclose(dense[0], expected)
    assert list(ids[0, :5]) == [0, 10, 255, 16, 0xDEADBEEF % 1000]
    assert list(labels) == [0.0, 0.0]  # an empty label is 0, as in TorchRec


def test_crlf_and_a_missing_final_newline(tmp_path):
    lines = [_line("1", cats=["b"] * 26).replace("\n", "\r\n"), _line("0", cats=["c"] * 26)[:-1]]
    _, ids, labels = _read_all(
        CriteoTsvReader(_write(tmp_path / "crlf.tsv", lines), table_sizes=(100,) * 26, batch_size=8)
    )
    assert ids[:, -1].tolist() == [11, 12] and labels.tolist() == [1.0, 0.0]


@pytest.mark.parametrize(
    "bad, problem",
    [
        (_line()[:-4] + "\n", "40 tab-separated fields"),  # last cell dropped
        (_line(ints=["x"] + ["1"] * 12), "I1 = 'x' is not an integer"),
        (_line(ints=["1"] * 12 + ["-"]), "I13 = '-' is not an integer"),
        (_line(ints=["1"] * 12 + ["1" * 19]), "not an integer"),
        (_line(cats=["zz"] * 26), "C1 = 'zz' is not hex"),
        (_line(cats=["123456789"] * 26), "hex"),
        (_line(cats=["é"] * 26), "hex"),
        (_line(label="2"), "label"),
    ],
)
def test_a_bad_line_names_file_and_line(tmp_path, bad, problem):
    path = _write(tmp_path / "bad.tsv", [_line(), _line(), bad, _line()])
    with pytest.raises(CriteoFormatError, match=f"bad.tsv:3: .*{problem}") as info:
        list(CriteoTsvReader(path, table_sizes=SIZES, batch_size=2))
    assert info.value.line == 3
    # Rank 0 of 2 reads lines 1 and 3 only; rank 1 never sees the bad line.
    with pytest.raises(CriteoFormatError, match="bad.tsv:3"):
        list(CriteoTsvReader(path, table_sizes=SIZES, batch_size=2, rank=0, world_size=2))
    assert (
        len(list(CriteoTsvReader(path, table_sizes=SIZES, batch_size=2, rank=1, world_size=2))) == 1
    )


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_cover_every_line_once(tmp_path, world):
    paths = [_numbered(tmp_path / "a.tsv", 10), _numbered(tmp_path / "b.tsv", 7, first=10)]
    seen = []
    for rank in range(world):
        reader = CriteoTsvReader(
            paths, table_sizes=SIZES, batch_size=4, rank=rank, world_size=world
        )
        dense, _, _ = _read_all(reader)
        numbers = np.rint(np.expm1(dense[:, 0])).astype(int)
        assert all(n % world == rank for n in numbers)
        seen += numbers.tolist()
    assert sorted(seen) == list(range(17))


def _handmade_npy(tmp_path: Path, n: int) -> tuple[Path, Path, Path]:
    rng = np.random.default_rng(0)
    arrays = {
        "dense": rng.random((n, 13), dtype=np.float32),
        "sparse": rng.integers(0, 2**32, (n, 26), dtype=np.int64),
        "labels": rng.integers(0, 2, (n, 1), dtype=np.int32),
    }
    for name, arr in arrays.items():
        np.save(tmp_path / f"day_0_{name}.npy", arr)
    return tuple(tmp_path / f"day_0_{name}.npy" for name in arrays)


def test_npy_round_trip_and_rank_split(tmp_path):
    paths = _handmade_npy(tmp_path, 23)
    dense, sparse, labels = (np.load(p) for p in paths)
    sizes = tuple(range(3, 29))
    parts = []
    for rank in range(2):
        reader = CriteoNpyReader(*paths, table_sizes=sizes, batch_size=5, rank=rank, world_size=2)
        assert len(reader) == len(list(reader)) == 3  # 11 and 12 rows
        parts.append(_read_all(reader))
    got_dense, got_ids, got_labels = (np.concatenate(x) for x in zip(*parts, strict=True))
    np.testing.assert_array_equal(got_dense, dense)
    np.testing.assert_array_equal(got_ids, sparse % np.array(sizes))
    np.testing.assert_array_equal(got_labels, labels[:, 0].astype(np.float32))
    from_day = CriteoNpyReader.from_day(
        tmp_path, 0, table_sizes=sizes, batch_size=5, drop_last=True
    )
    assert len(from_day) == len(list(from_day)) == 4


def test_npy_written_by_torchrec_matches_the_tsv_reader(tmp_path):
    criteo = pytest.importorskip("torchrec.datasets.criteo")
    tsv = _write(
        tmp_path / "day.tsv", [_line(str(i % 2), cats=[f"{i:x}f3"] * 26) for i in range(9)]
    )
    paths = [tmp_path / f"day_0_{p}.npy" for p in ("dense", "sparse", "labels")]
    # "criteo_1tb": for "criteo_kaggle", a path containing "test" (as pytest's do) is read as the
    # label-less Kaggle test set.
    criteo.BinaryCriteoUtils.tsv_to_npys(str(tsv), *map(str, paths), dataset_name="criteo_1tb")
    npy = _read_all(CriteoNpyReader(*paths, table_sizes=CRITEO_KAGGLE_TABLE_SIZES, batch_size=4))
    raw = _read_all(CriteoTsvReader(tsv, table_sizes=CRITEO_KAGGLE_TABLE_SIZES, batch_size=4))
    np.testing.assert_array_equal(npy[1], raw[1])  # ids
    np.testing.assert_array_equal(npy[2], raw[2])  # labels


def test_shapes_and_arguments_are_validated(tmp_path):
    dense, sparse, labels = _handmade_npy(tmp_path, 5)
    np.save(sparse, np.zeros((5, 25), dtype=np.int64))
    with pytest.raises(CriteoFormatError, match="sparse.npy: expected shape"):
        CriteoNpyReader(dense, sparse, labels, table_sizes=SIZES, batch_size=2)
    with pytest.raises(DistcacheConfigError, match="table_sizes"):
        CriteoTsvReader(tmp_path / "x.tsv", table_sizes=(5,) * 25, batch_size=2)
    with pytest.raises(DistcacheConfigError, match="rank"):
        CriteoTsvReader(tmp_path / "x.tsv", table_sizes=SIZES, batch_size=2, rank=2, world_size=2)
