"""distcache's sharder against the unsharded, uncached EmbeddingBagCollection (gloo, CPU)."""

import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.sharded_model import train_and_compare


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "kind", ["table_wise", "row_wise", "column_wise", "table_row_wise", "mixed", "planner"]
)
def test_sharded_cached_sgd_equals_unsharded_bitwise(kind):
    results = run_ranks(train_and_compare, 2, args=(kind,), timeout_s=150)
    evicting = [s for stats in results for s in stats.values() if s["evictions"] > 0]
    assert evicting, "caches must be small enough to evict"
