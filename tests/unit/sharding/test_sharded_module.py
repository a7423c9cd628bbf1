"""`cache_stats(model)` names each cache as the user named the module (`ebc/...`), as
`LookaheadTrainPipeline.stats()` does, not by DMP's wrapped path; the id check of a batch's
keys (`_check_feature_ids`)."""

from __future__ import annotations

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from distcache.cache import fused_native
from distcache.cache.ids import first_invalid
from distcache.errors import InvalidBatchError
from distcache.pipeline import LookaheadTrainPipeline
from distcache.sharding import cache_stats
from distcache.sharding.sharded_module import CachedShardedModule, user_path
from tests.distributed.pipeline_sweep_case import sweep_batches
from tests.unit.pipeline.test_lookahead import one_rank  # noqa: F401 (fixture)
from tests.unit.pipeline.test_recovery import _model


@pytest.mark.parametrize(
    ("path", "user"),
    [
        ("_dmp_wrapped_module.module.ebc", "ebc"),
        ("_dmp_wrapped_module.ebc", "ebc"),
        ("model.sparse_arch.ebc", "model.sparse_arch.ebc"),
        ("_dmp_wrapped_module", ""),
    ],
)
def test_user_path_drops_the_wrappers_only(path: str, user: str) -> None:
    assert user_path(path) == user


def test_cache_stats_and_the_pipeline_name_caches_alike(one_rank: None) -> None:  # noqa: F811
    model = _model()
    pipeline = LookaheadTrainPipeline(model, None, "cpu")
    batches = iter(
        Batch(
            dense_features=torch.zeros(k.stride(), 1),
            sparse_features=k,
            labels=torch.zeros(k.stride()),
        )
        for k in sweep_batches(4, 1, 9)
    )
    with pytest.raises(StopIteration):
        while True:
            pipeline.progress(batches)
    names = set(cache_stats(model))
    assert names == set(pipeline.stats()) - {"total"}
    assert names and all(name.startswith("ebc/") for name in names), names


class _Rows(CachedShardedModule):
    """The id check alone: features 'a', 'b', 'c' of tables of 3, 4 and 5 rows."""

    def __init__(self) -> None:
        self._rows_of_feature = {"a": ("ta", 3), "b": ("tb", 4), "c": ("tc", 5)}


# The torch ops; the C kernel (CPU); and the C kernel that checks the lengths too, for the
# batches it takes (int64 ids, one batch size).
@pytest.mark.parametrize("fused_ids", [False, True, "one pass"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(
    ("strides", "lengths", "values", "record"),
    [
        ([2, 2, 2], [1, 2, 0, 0, 1, 1], [2, 3, 0, 4, 4], [1, 1, 3, 0]),  # a has 3 rows
        ([2, 2, 2], [1, 2, 0, 0, 1, 1], [2, 1, 0, 4, 5], [1, 4, 5, 2]),
        ([2, 0, 3], [1, 1, 0, 2, 1], [0, 2, 9, -1, 4], [2, 2, 9, 2]),  # b has no bags
        ([0, 1, 2], [0, 1, 1], [1, 4], [0, 0, 1, 2]),  # a has no bags, b no ids
        ([1, 1, 1], [0, 0, 0], [], [0, 0, 0, 0]),
        ([0, 0, 0], [], [], [0, 0, 0, 0]),
    ],
)
def test_check_feature_ids_records_the_first_invalid_id(
    strides: list[int], lengths: list[int], values: list[int], record: list[int], dtype, fused_ids
) -> None:
    """Ids out of their key's rows become 0, they are counted and the record names the first;
    keys may have different strides (variable batch) and no bags or no ids."""
    variable = len(set(strides)) > 1
    features = KeyedJaggedTensor(
        keys=["a", "b", "c"],
        values=torch.tensor(values, dtype=dtype),
        lengths=torch.tensor(lengths, dtype=dtype),
        **({"stride_per_key_per_rank": [[s] for s in strides]} if variable else {}),
        **({} if variable else {"stride": strides[0]}),
    )
    rows = _Rows()
    rows.fused_ids = bool(fused_ids) and fused_native.load() is not None
    one_pass = fused_ids == "one pass" and rows._checks_in_one_pass(features)
    # It takes int64 ids of one batch size (where a C compiler built it); the others go on.
    eligible = rows.fused_ids and dtype == torch.int64 and not variable
    assert one_pass == (fused_ids == "one pass" and eligible)
    checked, check, kept = rows._check_feature_ids(features, one_pass=one_pass)
    assert check.read() == record[:1]  # the count reaches the host with the batch
    if record[0]:  # and only then is the batch read to name the first invalid id
        assert first_invalid(*kept) == record
    want = [v if v >= 0 and v < record_bound else 0 for v, record_bound in _bounds(features)]
    assert checked.values().tolist() == want and checked.values().dtype == dtype
    assert features.values().tolist() == values  # the caller's batch is left as it was
    assert checked.stride_per_key() == strides


@pytest.mark.skipif(fused_native.load() is None, reason="no C compiler built the C kernels")
@pytest.mark.parametrize(
    ("lengths", "values"),
    [
        ([1, 2, 0, 0, 1, 1], [2, 1, 0, 4]),  # five ids by the lengths, four given
        ([1, 2, 0, 0, 1, 1], [2, 1, 0, 4, 4, 0]),  # six given
        ([1, 2, -1, 0, 2, 1], [2, 1, 0, 4, 4]),  # five, one length negative
    ],
)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_lengths_checked_with_the_ids_are_refused_as_by_the_batch_check(lengths, values, dtype):
    """Where one C call checks a batch's lengths with its ids, lengths that do not give its ids
    are refused with `_check_batch`'s own message."""
    features = KeyedJaggedTensor(
        keys=["a", "b", "c"],
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=dtype),
        stride=2,
    )
    rows = _Rows()
    rows.fused_ids = True
    assert rows._checks_in_one_pass(features)
    with pytest.raises(InvalidBatchError) as two_passes:
        rows._check_batch(features)
    with pytest.raises(InvalidBatchError, match="lengths add up to") as one_pass:
        rows._check_feature_ids(features, one_pass=True)
    assert str(one_pass.value) == str(two_passes.value)


def _bounds(features: KeyedJaggedTensor) -> list[tuple[int, int]]:
    rows = {"a": 3, "b": 4, "c": 5}
    return [(v, rows[key]) for key in features.keys() for v in features[key].values().tolist()]


def test_contexts_routed_on_another_stream_are_kept_for_the_computing_one(monkeypatch) -> None:
    """TorchRec's pipelines route a batch on a stream of their own and compute it on the
    current one, recording their context's tensors for it: distcache's additions to the
    context (the id check's, the hot ids') are kept for it too, and only when the streams
    differ (CUDA's streams stood in for on a CPU)."""
    import distcache.sharding.sharded_module as sharded_module

    kept = []
    monkeypatch.setattr(sharded_module, "keep_all_for", lambda v, s: kept.append((v, s)))
    now = {"stream": "dist"}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: now["stream"])

    class _Stream(str):
        device_index = 0

    class _Ctx:
        distcache_stream = _Stream("dist")
        distcache_hot, distcache_cold = "hot part", ("keys", "lengths")

    now["stream"] = _Stream("dist")  # computed on the stream that routed it: nothing to keep
    CachedShardedModule._keep_context_here(None, _Ctx())
    assert kept == []
    now["stream"] = "default"
    CachedShardedModule._keep_context_here(None, _Ctx())
    assert kept == [([None, "hot part", ("keys", "lengths")], "default")]


def test_torchrecs_cache_load_factor_sizes_the_sharded_caches(one_rank: None) -> None:  # noqa: F811
    """Through DMP: `fused_params={"cache_load_factor": 0.05}` on distcache's sharder (as
    on TorchRec's for its UVM cache) gives caches of 5 % of the rows; before, they held every
    row (the default config's capacity overwrote it)."""
    from distcache import CacheConfig
    from distcache.sharding import CachedEmbeddingBagCollectionSharder
    from tests.distributed.sharded_model import make_ebc, per_table_plan, plan_for

    ebc = make_ebc()
    for params, fraction in (({"cache_load_factor": 0.05}, 0.05), ({}, 1.0)):
        sharder = CachedEmbeddingBagCollectionSharder(CacheConfig(), fused_params=params)
        model = per_table_plan(
            ebc, "", ebc, plan_for("table_wise", 1), sharder, init_data_parallel=False
        )
        for name, stats in cache_stats(model).items():  # (rows rounded up per table)
            tables = name.count("+") + 1
            expected = (fraction * stats.num_rows, fraction * stats.num_rows + tables)
            assert expected[0] <= stats.capacity <= expected[1], (name, stats.capacity)
