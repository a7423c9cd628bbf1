"""DLRM trained under DMP with distcache's sharder matches TorchRec's default sharder."""

import pytest

from tests.distributed.dlrm_case import train_both
from tests.distributed.harness import run_ranks


@pytest.mark.timeout(240)
def test_dlrm_losses_match_torchrec_default_sharder():
    results = run_ranks(train_both, 2, kwargs={"steps": 20, "capacity": 0.1}, timeout_s=200)
    for rank, result in enumerate(results):
        ours, theirs = result["losses"]["distcache"], result["losses"]["torchrec"]
        assert len(ours) == len(theirs) == 20
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-6), (rank, step, a, b)
    evictions = sum(s["evictions"] for r in results for s in r["stats"].values())
    assert evictions > 0, "10 % caches must evict"
