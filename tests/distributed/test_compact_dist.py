"""The compact output dist (`distcache.sharding.compact_dist`): the pooled outputs of the bags
that have ids, against TorchRec's own pooled all-to-all (2 and 3 gloo ranks)."""

import pytest

from tests.distributed.compact_case import compact_equals_torchrec
from tests.distributed.harness import run_ranks


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("world", "empty", "seed"),
    [(2, 0.0, 0), (2, 0.6, 1), (2, 1.0, 2), (3, 0.5, 3), (3, 0.9, 4)],
)
def test_compact_dist_equals_torchrecs(world, empty, seed):
    results = run_ranks(compact_equals_torchrec, world, args=(4, empty, seed), timeout_s=120)
    sent = sum(r["sent"] for r in results)
    full = sum(r["full"] for r in results)
    if empty == 0.0:
        assert sent == full  # every bag has ids: everything is sent
    elif empty == 1.0:
        assert sent == 0
    else:
        assert sent < full
