"""The scheduler's fused passes compiled for CUDA (`CacheConfig.fused`) against the torch ops,
with and without CUDA graphs: `tests/unit/cache/test_fused.py`'s checks on the device, where
Triton compiles the kernels the unit tests interpret."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.gpu.common import CUDA_REASON
from tests.unit.cache.test_fused import compare_routing, compare_training, run_pair

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize(
    ("policy", "capacity", "lookahead", "sizes"),
    [
        ("lookahead", 60, 4, [50] * 30),
        ("lookahead", 400, 8, [37, 300, 5, 128, 1, 90] * 5),
        ("lru", 80, 3, [64] * 25),
        ("lookahead", 1000, 2, [200] * 12),
    ],
)
def test_the_compiled_fused_scheduler_matches_the_torch_ops(
    policy, capacity, lookahead, sizes, graphs
):
    run_pair(policy, capacity, lookahead, sizes, device="cuda", graphs=graphs)


def test_cached_bags_with_the_compiled_fused_scheduler_train_as_without():
    """With the CUDA defaults (graphs, direct staging): outputs, counters and flushed rows."""
    compare_training("cuda")


@pytest.mark.parametrize("padded_ids", [False, True])
@pytest.mark.parametrize("check_ids", [True, False])
def test_the_compiled_fused_routing_matches_the_torch_ops(padded_ids, check_ids):
    compare_routing("cuda", padded_ids, check_ids)
