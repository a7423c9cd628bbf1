"""The compact output dist (`distcache.sharding.compact_dist`): the pooled outputs of the bags
that have ids, against TorchRec's own pooled all-to-all (2 and 3 gloo ranks)."""

import pytest

from tests.distributed.compact_case import compact_equals_torchrec
from tests.distributed.harness import run_ranks


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("world", "empty", "seed", "width"),
    [(2, 0.0, 0, None), (2, 0.6, 1, None), (2, 1.0, 2, 4), (3, 0.9, 4, None), (3, 0.5, 7, 4)],
)
def test_compact_dist_equals_torchrecs(world, empty, seed, width):
    """Features of mixed widths (outputs gathered element by element) and of one width
    (whole rows)."""
    results = run_ranks(compact_equals_torchrec, world, args=(4, empty, seed, width), timeout_s=120)
    sent = sum(r["sent"] for r in results)
    full = sum(r["full"] for r in results)
    if empty == 0.0:
        assert sent == full  # every bag has ids: everything is sent
    elif empty == 1.0:
        assert sent == 0
    else:
        assert sent < full
