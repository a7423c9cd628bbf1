"""Criteo click-log readers: raw TSV files and TorchRec's preprocessed `.npy` days.

Both yield `torchrec.datasets.utils.Batch`es shaped as TorchRec's own Criteo pipeline shapes
them: dense [B, 13] float32, one single-id bag per sample for each of the 26 categorical
features (keys f0..f25, the names `distcache.job.dlrm` gives its features), labels [B] float32.

Conventions, those of TorchRec's `torchrec/datasets/criteo.py`:
- an empty categorical cell is the hex string "0", so id 0 (never an empty bag), and every id is
  taken modulo its table's size (the "hashing" of the DLRM reference);
- an empty integer cell is 0; raw TSV dense values become `log(1 + max(x, 0))` (the DLRM
  reference transform), while `.npy` dense values are read as stored (TorchRec's preprocessing
  has already taken the logarithm);
- an empty label is 0.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from distcache.errors import DistcacheConfigError, DistcacheError

if TYPE_CHECKING:  # TorchRec loads with the first batch: parsing configs stays light
    from torchrec.datasets.utils import Batch

__all__ = [
    "CAT_FEATURE_COUNT",
    "CRITEO_KAGGLE_TABLE_SIZES",
    "CRITEO_TERABYTE_TABLE_SIZES",
    "CriteoFormatError",
    "CriteoNpyReader",
    "CriteoTsvReader",
    "INT_FEATURE_COUNT",
    "feature_names",
]

INT_FEATURE_COUNT = 13
CAT_FEATURE_COUNT = 26
_FIELDS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
_CHUNK_LINES = 1 << 14  # lines read at a time; parsing takes a few KB of scratch per line

CRITEO_KAGGLE_TABLE_SIZES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
"""Rows per table of Criteo Kaggle, as in the DLRM reference."""
CRITEO_TERABYTE_TABLE_SIZES = (
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208,
    11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36,
)  # fmt: skip
"""Rows per table of Criteo Terabyte with ids hashed to at most 40M rows (MLPerf DLRM)."""

_COLUMNS = ("label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27)))
_TAB, _NEWLINE, _CR, _ZERO = (np.uint8(ord(c)) for c in "\t\n\r0")
_MAX_DIGITS = 18  # decimal digits that always fit in int64
_DECIMAL = np.full(256, -1, dtype=np.int8)  # byte -> digit; -1: not a decimal digit
_DECIMAL[_ZERO : _ZERO + 10] = np.arange(10)
_HEX = np.full(256, -1, dtype=np.int8)  # byte -> nibble; -1: not a hex digit
for _digits, _first in ((b"0123456789", 0), (b"abcdef", 10), (b"ABCDEF", 10)):
    _HEX[np.frombuffer(_digits, dtype=np.uint8)] = np.arange(_first, _first + len(_digits))
_NIBBLE_SHIFT = 4 * np.arange(7, -1, -1, dtype=np.int64)  # [8]: the weight of each hex digit


def feature_names(num_tables: int) -> list[str]:
    """Sparse feature names f0, f1, ...: feature i reads table i."""
    return [f"f{i}" for i in range(num_tables)]


class CriteoFormatError(DistcacheError, ValueError):
    """A Criteo file does not hold what the reader expects; names the file and 1-based line."""

    def __init__(self, path: str | Path, line: int | None, problem: str) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {problem}")
        self.path, self.line = str(path), line


def _check_reader_args(table_sizes: Sequence[int], batch_size: int, rank: int, world: int) -> None:
    sizes = list(table_sizes)
    if len(sizes) != CAT_FEATURE_COUNT or any(
        not isinstance(r, int | np.integer) or r < 1 for r in sizes
    ):
        raise DistcacheConfigError(
            f"table_sizes must hold {CAT_FEATURE_COUNT} ints >= 1, got {table_sizes!r}"
        )
    if batch_size < 1:
        raise DistcacheConfigError(f"batch_size must be >= 1, got {batch_size}")
    if world < 1 or not 0 <= rank < world:
        raise DistcacheConfigError(
            f"need world_size >= 1 and rank in [0, world_size), got rank={rank}, world_size={world}"
        )


def _to_batch(dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> Batch:
    """A Batch from dense [B, 13] float32, ids [B, 26] int64 (in range) and labels [B] float32."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    size = dense.shape[0]
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(dense)),
        sparse_features=KeyedJaggedTensor(
            keys=feature_names(CAT_FEATURE_COUNT),
            values=torch.from_numpy(np.ascontiguousarray(sparse.T).reshape(-1)),  # feature-major
            lengths=torch.ones(CAT_FEATURE_COUNT * size, dtype=torch.int32),
            stride=size,
        ),
        labels=torch.from_numpy(np.ascontiguousarray(labels)),
    )


def _cell_bytes(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, width: int) -> np.ndarray:
    """The bytes of cells [n, k] (byte ranges of `buf`), right-aligned in [n, k, width] and
    padded on the left with '0', so that digit j always has the weight base^(width - 1 - j)."""
    pos = ends[..., None] - width + np.arange(width)  # [n, k, width]
    return np.where(pos >= starts[..., None], buf[np.maximum(pos, 0)], _ZERO)


def _decimal_cells(
    buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Signed decimal cells [n, k] as int64 (empty: 0) and a mask of the unparsable ones."""
    negative = (ends > starts) & (buf[starts] == ord("-"))
    first = starts + negative
    length = ends - first
    width = int(np.clip(length.max(initial=1), 1, _MAX_DIGITS))
    digits = _DECIMAL[_cell_bytes(buf, first, ends, width)]  # [n, k, width], -1: not a digit
    bad = (digits < 0).any(axis=2) | (length > _MAX_DIGITS) | (negative & (length == 0))
    value = digits @ 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    return np.where(negative, -value, value), bad


def _hex_cells(
    buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Hex cells of at most 8 digits [n, k] as int64 (empty: 0) and a mask of the bad ones."""
    nibbles = _HEX[_cell_bytes(buf, starts, ends, 8)]  # [n, k, 8], -1: not a hex digit
    bad = (nibbles < 0).any(axis=2) | (ends - starts > 8)
    return (nibbles << _NIBBLE_SHIFT).sum(axis=2), bad


def _split_fields(
    buf: np.ndarray, path: Path, line_numbers: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Byte ranges [start, end) [n, 40] of the fields of n lines, each ending in a newline."""
    seps = np.flatnonzero((buf == _TAB) | (buf == _NEWLINE))  # [n * 40] when well formed
    line_ends = np.flatnonzero(buf[seps] == _NEWLINE)  # [n]: index in seps of each newline
    fields = np.diff(line_ends, prepend=-1)  # [n]
    bad = np.flatnonzero(fields != _FIELDS)
    if bad.size:
        problem = (
            f"expected {_FIELDS} tab-separated fields (label, I1..I13, C1..C26), "
            f"got {fields[bad[0]]}"
        )
        raise CriteoFormatError(path, int(line_numbers[bad[0]]), problem)
    ends = seps.reshape(-1, _FIELDS)
    starts = np.empty_like(ends)
    starts[:, 1:] = ends[:, :-1] + 1
    starts[0, 0], starts[1:, 0] = 0, ends[:-1, -1] + 1
    last = ends[:, -1]
    ends[(last > starts[:, -1]) & (buf[last - 1] == _CR), -1] -= 1  # a CRLF's CR is no data
    return starts, ends


def _parse_lines(
    buf: np.ndarray, path: Path, line_numbers: np.ndarray, table_sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Whole TSV lines as bytes -> dense [n, 13] float32, ids [n, 26] int64 (modulo
    table_sizes), labels [n] float32. Vectorized over the bytes: no Python loop per line or id.
    """
    starts, ends = _split_fields(buf, path, line_numbers)
    ints, bad_int = _decimal_cells(buf, starts[:, :14], ends[:, :14])  # label, I1..I13
    ids, bad_hex = _hex_cells(buf, starts[:, 14:], ends[:, 14:])
    bad_int[:, 0] |= (ints[:, 0] != 0) & (ints[:, 0] != 1)
    bad = np.concatenate([bad_int, bad_hex], axis=1)  # [n, 40]
    if bad.any():
        row, col = np.argwhere(bad)[0]
        cell = bytes(buf[starts[row, col] : ends[row, col]]).decode(errors="replace")
        problem = ["must be 0 or 1", "is not an integer", "is not hex of at most 8 digits"]
        kind = 0 if col == 0 else 1 if col < 14 else 2
        raise CriteoFormatError(
            path, int(line_numbers[row]), f"{_COLUMNS[col]} = {cell!r} {problem[kind]}"
        )
    dense = np.log1p(np.maximum(ints[:, 1:], 0)).astype(np.float32)
    return dense, ids % table_sizes, ints[:, 0].astype(np.float32)


class CriteoTsvReader:
    """Batches from raw Criteo TSV files (label, I1..I13, C1..C26; tab-separated, no header).

    Lines are numbered across `paths` in order; rank r reads lines i with i % world_size == r
    (every rank scans every file, and ranks' batch counts differ by at most one). Batches span
    file boundaries; the last one is partial unless `drop_last`. A line with a wrong number of
    fields or an unparsable cell raises `CriteoFormatError` naming the file and line.

    Args:
        paths: One TSV file or several, read in order.
        table_sizes: Rows of each of the 26 tables; ids are taken modulo these.
        batch_size: Samples per batch.
        rank: This rank, in [0, world_size).
        world_size: Ranks sharing the files.
        drop_last: Drop this rank's final partial batch.

    Example::

        reader = CriteoTsvReader("train.tsv", table_sizes=CRITEO_KAGGLE_TABLE_SIZES, batch_size=512)
        for batch in reader:
            ...
    """

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        *,
        table_sizes: Sequence[int],
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ) -> None:
        _check_reader_args(table_sizes, batch_size, rank, world_size)
        self.paths = [Path(paths)] if isinstance(paths, str | Path) else [Path(p) for p in paths]
        self.table_sizes = np.array(table_sizes, dtype=np.int64)  # [26]
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.drop_last = drop_last

    def _chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """This rank's lines, parsed a chunk at a time."""
        first = 0  # global index of the chunk's first line
        for path in self.paths:
            with open(path, "rb") as f:
                file_first = first  # global index of the file's line 1
                while lines := list(islice(f, _CHUNK_LINES)):
                    skip = (self.rank - first) % self.world_size
                    own = lines[skip :: self.world_size]
                    if own:
                        if not own[-1].endswith(b"\n"):  # the file's last line
                            own[-1] += b"\n"
                        buf = np.frombuffer(b"".join(own), dtype=np.uint8)
                        offsets = skip + self.world_size * np.arange(len(own))  # [len(own)]
                        numbers = first - file_first + 1 + offsets  # 1-based, in this file
                        yield _parse_lines(buf, path, numbers, self.table_sizes)
                    first += len(lines)

    def __iter__(self) -> Iterator[Batch]:
        pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        held = 0
        for chunk in self._chunks():
            pending.append(chunk)
            held += len(chunk[2])
            if held < self.batch_size:
                continue
            dense, ids, labels = (np.concatenate(parts) for parts in zip(*pending, strict=True))
            full = held // self.batch_size * self.batch_size
            for s in range(0, full, self.batch_size):
                e = s + self.batch_size
                yield _to_batch(dense[s:e], ids[s:e], labels[s:e])
            pending, held = [(dense[full:], ids[full:], labels[full:])], held - full
        if held and not self.drop_last:
            dense, ids, labels = (np.concatenate(parts) for parts in zip(*pending, strict=True))
            yield _to_batch(dense, ids, labels)


class CriteoNpyReader:
    """Batches from one day of TorchRec's preprocessed Criteo (`day_X_{dense,sparse,labels}.npy`).

    The layout is that of `torchrec/datasets/scripts/npy_preproc_criteo.py`: dense [N, 13]
    float32 (already log-transformed), sparse [N, 26] int (raw hashed categorical values),
    labels [N, 1] int32. The files are memory-mapped; each batch reads its rows only and takes
    the ids modulo `table_sizes`. Rank r reads the contiguous rows
    [N * r // world_size, N * (r + 1) // world_size).

    Args:
        dense_path: The `_dense.npy` file.
        sparse_path: The `_sparse.npy` file.
        labels_path: The `_labels.npy` file.
        table_sizes: Rows of each of the 26 tables.
        batch_size: Samples per batch.
        rank: This rank, in [0, world_size).
        world_size: Ranks sharing the day.
        drop_last: Drop this rank's final partial batch.

    Example::

        reader = CriteoNpyReader.from_day(
            "/data/criteo", 0, table_sizes=CRITEO_TERABYTE_TABLE_SIZES, batch_size=2048
        )
    """

    def __init__(
        self,
        dense_path: str | Path,
        sparse_path: str | Path,
        labels_path: str | Path,
        *,
        table_sizes: Sequence[int],
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ) -> None:
        _check_reader_args(table_sizes, batch_size, rank, world_size)
        self.dense = np.load(dense_path, mmap_mode="r")  # [N, 13]
        self.sparse = np.load(sparse_path, mmap_mode="r")  # [N, 26]
        self.labels = np.load(labels_path, mmap_mode="r")  # [N, 1] or [N]
        n = self.labels.shape[0] if self.labels.ndim else -1
        for path, arr, shape in (
            (dense_path, self.dense, (n, INT_FEATURE_COUNT)),
            (sparse_path, self.sparse, (n, CAT_FEATURE_COUNT)),
            (labels_path, self.labels, (n, 1) if self.labels.ndim == 2 else (n,)),
        ):
            if arr.shape != shape or n < 0:
                raise CriteoFormatError(path, None, f"expected shape {shape}, got {arr.shape}")
        self.table_sizes = np.array(table_sizes, dtype=np.int64)  # [26]
        self.batch_size, self.drop_last = batch_size, drop_last
        self.start, self.stop = n * rank // world_size, n * (rank + 1) // world_size

    @classmethod
    def from_day(cls, directory: str | Path, day: int, **kwargs) -> CriteoNpyReader:
        """The reader of `directory/day_{day}_{dense,sparse,labels}.npy`; kwargs as `__init__`."""
        base = Path(directory)
        paths = (base / f"day_{day}_{part}.npy" for part in ("dense", "sparse", "labels"))
        return cls(*paths, **kwargs)

    def __len__(self) -> int:
        full, rest = divmod(self.stop - self.start, self.batch_size)
        return full + (rest > 0 and not self.drop_last)

    def __iter__(self) -> Iterator[Batch]:
        for s in range(self.start, self.stop, self.batch_size):
            e = min(s + self.batch_size, self.stop)
            if e - s < self.batch_size and self.drop_last:
                return
            yield _to_batch(
                np.asarray(self.dense[s:e], dtype=np.float32),
                self.sparse[s:e].astype(np.int64) % self.table_sizes,
                np.asarray(self.labels[s:e], dtype=np.float32).reshape(-1),
            )
