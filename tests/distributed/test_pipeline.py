"""LookaheadTrainPipeline: same results as the plain loop, no critical-path miss, all batches."""

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.pipeline_case import pipelined_vs_plain


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_pipeline_equals_plain_loop_without_critical_misses(kind):
    for runs in run_ranks(pipelined_vs_plain, 2, args=(kind,), timeout_s=200):
        plain, piped = runs["plain"], runs["pipeline"]
        assert piped["logits"].shape == plain["logits"].shape  # every batch trained
        assert torch.equal(piped["logits"], plain["logits"])
        for key, shards in plain["weights"].items():
            for a, b in zip(shards, piped["weights"][key], strict=True):
                assert torch.equal(a, b), key
        assert plain["critical"] > 0 and piped["critical"] == 0
        assert piped["loads"] > 0 and piped["evictions"] > 0
