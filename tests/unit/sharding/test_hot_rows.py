"""`HotRows.split` against a plain-Python reference: which ids are hot, where they go."""

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from distcache.cache.config import CacheConfig
from distcache.errors import DistcacheConfigError
from distcache.sharding.hot_rows import HotRows

HOT = {"a": (3, 7, 40), "b": (0, 7), "c": (5,)}  # table -> its hot rows
DIMS = {"a": 4, "b": 4, "c": 8}  # two widths


def _hot_rows() -> HotRows:
    tables = {t: (50, DIMS[t], CacheConfig(hot_rows=rows)) for t, rows in HOT.items()}
    features = {"fa": "a", "fb": "b", "fb2": "b", "fc": "c", "fz": "z"}  # z: no hot rows
    return HotRows(tables, features, set(), torch.device("cpu"))


def test_split_matches_a_reference():
    keys = ["fz", "fa", "fb", "fb2", "fc"]
    table = {"fa": "a", "fb": "b", "fb2": "b", "fc": "c"}
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 4, (len(keys) * 3,), generator=g)  # B = 3
    values = torch.randint(0, 12, (int(lengths.sum()),), generator=g)
    values[::5] = 7  # hot in a and b, not in c; in fz's table none is hot
    values[1] = -1  # invalid ids (the shards report them) are never hot
    values[2] = (1 << 40) + 7
    kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
    rest, part = _hot_rows().split(kjt)
    expected_cold, expected_hot = [], []
    ends = kjt.offset_per_key()
    for k, key in enumerate(keys):
        for v in values[ends[k] : ends[k + 1]].tolist():
            is_hot = key in table and v in HOT[table[key]]
            (expected_hot if is_hot else expected_cold).append((key, v))
    assert rest.values().tolist() == [v for _, v in expected_cold]
    assert int(part.hot_per_bag.sum()) == len(expected_hot)
    assert (rest.lengths() + part.hot_per_bag).tolist() == lengths.tolist()
    # Each hot id found at its row of its table's replica (the widths: a and b, then c).
    found = []
    hot = _hot_rows()
    for width, ids in zip(hot.widths, part.widths, strict=True):
        tables = [t for t in hot.tables.values() if t.dim == width.dim]
        for r in ids.rows.tolist():
            owner = next(
                t for t in tables if t.row - width.row <= r < t.row - width.row + len(t.ids)
            )
            found.append((owner.name, owner.ids[r - (owner.row - width.row)].item()))
    assert sorted(found) == sorted((table[k], v) for k, v in expected_hot)


def test_tables_of_2_to_the_40_rows_are_refused():
    with pytest.raises(DistcacheConfigError, match="fewer than 1099511627776 rows"):
        HotRows({"t": (1 << 40, 4, CacheConfig(hot_rows=(1,)))}, {"f": "t"}, set(), "cpu")


@pytest.mark.parametrize("reduce", ["touched", "all"])
@pytest.mark.parametrize("lrs", [(0.5, 0.5), (0.5, 0.25)])  # alike optimizers, or not
def test_one_process_step_updates_only_the_touched_rows(reduce, lrs):
    """One process: a sum of the pooled rows, backward, and the step. Each touched row moves by
    -lr x (its ids' count), every other row (the other tables' of the width too) and its
    state stay; per table its own rate, whether the width's tables are updated together
    (alike optimizers) or one by one."""
    configs = {
        t: CacheConfig(hot_rows=HOT[t], hot_reduce=reduce, learning_rate=lr, optimizer="adagrad")
        for t, lr in zip("ab", lrs, strict=True)
    }
    hot = HotRows({t: (50, 4, c) for t, c in configs.items()}, {"fa": "a", "fb": "b"}, set(), "cpu")
    hot.stale = False
    start = torch.arange(hot.flat.numel(), dtype=torch.float32)
    hot.flat.copy_(start)
    kjt = KeyedJaggedTensor(
        keys=["fa", "fb"],
        values=torch.tensor([7, 7, 3, 1, 0, 9]),
        lengths=torch.tensor([2, 1, 1, 2]),
    )  # a: 7 twice, 3 once (40 not); b: 0 once (1, 9 cold)
    _, part = hot.split(kjt)
    sum(v.sum() for v in hot.pooled(part).values()).backward()
    hot.finish_step()
    uses = {"a": {3: 1, 7: 2}, "b": {0: 1}}
    for name, table in hot.tables.items():
        lr = configs[name].learning_rate
        before = table.rows_of(start).clone()
        for i, row in enumerate(table.ids.tolist()):
            count = uses[name].get(row, 0)
            # Adagrad, a gradient of `count` in each column: s = count^2, step lr·count/(count+eps)
            want = before[i] - (lr * count / (abs(count) + 1e-8) if count else 0.0)
            assert torch.allclose(table.rows_of(hot.flat)[i], want), (name, row)
            assert torch.allclose(table.state[i], torch.full((4,), float(count**2))), (name, row)
    assert hot.widths[0].view(hot.flat, scratch=True).shape[0] == hot.widths[0].rows + 1


SEQUENCE_FEATURES = {"fa": "a", "fb": "b", "fb2": "b"}  # feature -> its table (a and b)


def _sequence_tables() -> dict[str, torch.Tensor]:
    """The plain tables `[50, 4]` of the per-id tests, on the CPU."""
    return {t: torch.arange(200, dtype=torch.float32).view(50, 4) % 11 + i
            for i, t in enumerate("ab")}  # fmt: skip


def _sequence_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(lengths, values) of the per-id tests' batch (B = 3, every third id 7: hot in a and b)."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 5, (len(SEQUENCE_FEATURES) * 3,), generator=g)
    values = torch.randint(0, 12, (int(lengths.sum()),), generator=g)
    values[::3] = 7
    return lengths, values


def sequence_step(device: torch.device | str, reduce: str = "touched") -> list[torch.Tensor]:
    """One step of per-id outputs (`EmbeddingCollection`) with hot rows, in one process: the
    split, the replica's rows put back among the cold ids' rows (taken here from a plain table
    `[50, 4]` per feature's table, as the shards would give them), a loss over every id's row,
    backward, SGD. Returns the output, the cold rows' gradient and the replica after the step."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    device = torch.device(device)
    lr = 0.5
    tables = {t: (50, 4, CacheConfig(hot_rows=HOT[t], hot_reduce=reduce, learning_rate=lr,
                                     optimizer="sgd")) for t in "ab"}  # fmt: skip
    features = SEQUENCE_FEATURES
    hot = HotRows(tables, features, set(), device, sequence=True)
    hot.stale = False
    weights = {t: w.to(device) for t, w in _sequence_tables().items()}
    for name, table in hot.tables.items():  # the replica holds the table's own rows
        table.rows_of(hot.flat).copy_(weights[name].index_select(0, table.ids))
    leaves = {t: w.clone().requires_grad_() for t, w in weights.items()}  # the shards' rows
    keys = list(features)
    lengths, values = _sequence_batch()
    kjt = KeyedJaggedTensor(keys=keys, values=values.to(device), lengths=lengths.to(device))
    rest, part = hot.split(kjt)
    cold = {
        key: JaggedTensor(
            values=leaves[features[key]].index_select(0, jt.values()), lengths=jt.lengths()
        )
        for key, jt in rest.to_dict(compute_offsets=False).items()  # no FBGEMM cumsum
    }
    out = hot.combine_sequence(cold, part, hot.rows(part))
    merged = torch.cat([out[key].values() for key in keys])
    scale = (torch.arange(merged.shape[0], device=device) % 3 + 1).unsqueeze(1).float()
    (merged * scale).sum().backward()
    hot.finish_step()
    grads = [leaves[t].grad for t in "ab"]
    return [merged.detach(), *(g.detach() for g in grads), hot.flat.detach(), scale]


@pytest.mark.parametrize("reduce", ["touched", "all"])
def test_sequence_outputs_and_step_match_plain_tables(reduce):
    """Per-id outputs with hot rows equal the plain tables' rows for every id, in place; the
    cold ids' gradient reaches the shards' rows and only them; each replica row takes the SGD
    step of its ids' gradients, as the plain table's row would."""
    merged, grad_a, grad_b, flat, scale = sequence_step("cpu", reduce)
    base = _sequence_tables()
    keys = list(SEQUENCE_FEATURES)
    lengths, values = _sequence_batch()
    ends = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths).offset_per_key()
    spans = zip(keys, ends, ends[1:], strict=False)
    table_of = [SEQUENCE_FEATURES[k] for k, a, b in spans for _ in range(b - a)]
    want = torch.stack([base[t][v] for t, v in zip(table_of, values.tolist(), strict=True)])
    assert torch.equal(merged, want)
    grads = {"a": grad_a, "b": grad_b}
    used = {"a": torch.zeros(50, 4), "b": torch.zeros(50, 4)}
    for i, (t, v) in enumerate(zip(table_of, values.tolist(), strict=True)):
        used[t][v] += scale[i]
    for t in "ab":
        hot_rows = list(HOT[t])
        cold_rows = [r for r in range(50) if r not in hot_rows]
        assert torch.equal(grads[t][cold_rows], used[t][cold_rows]), t
        assert not grads[t][hot_rows].any(), t  # hot ids never reach the shards
    # The replica's layout, as `sequence_step` built it.
    layout = HotRows({t: (50, 4, CacheConfig(hot_rows=HOT[t])) for t in "ab"}, {}, set(), "cpu")
    for name, table in layout.tables.items():
        want_rows = base[name][table.ids] - 0.5 * used[name][table.ids]
        assert torch.equal(table.rows_of(flat), want_rows), name
