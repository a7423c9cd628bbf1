"""`cache_stats(model)` names each cache as the user named the module (`ebc/...`), as
`LookaheadTrainPipeline.stats()` does, not by DMP's wrapped path."""

from __future__ import annotations

import pytest
import torch
from torchrec.datasets.utils import Batch

from distcache.pipeline import LookaheadTrainPipeline
from distcache.sharding import cache_stats
from distcache.sharding.sharded_module import user_path
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
