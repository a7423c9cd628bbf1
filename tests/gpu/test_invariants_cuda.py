"""DESIGN invariants 1-4 and 6 on CUDA, where rows move on the stager's side stream.

The checks of `tests/unit/cache/test_invariants.py` that take a `device`, imported here and run
with this module's `device` fixture (CUDA), plus invariants 1-2 with rows also staged ahead
while a batch trains (its loads then run concurrently with compute).
"""

import pytest
import torch

from tests.gpu.common import CUDA_REASON, to_device
from tests.unit.cache.reference import (
    loss_of,
    make_batches,
)
from tests.unit.cache.test_invariants import (  # noqa: F401 (collected here on CUDA)
    _setup,
    test_clean_rows_never_written_back_and_writes_precede_loads,
    test_flush_then_store_equals_reference_and_second_flush_writes_nothing,
    test_load_clears_cached_rows,
    test_state_dict_flushes_and_round_trips,
)

DEVICE = torch.device("cuda")
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason=CUDA_REASON
)
ROWS = 40


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def _settle(engine) -> None:
    """Wait for the stager's worker thread and every stream before reading the cache from the
    host."""
    engine.stager.drain()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def _reference_step(ref, opt, batch) -> torch.Tensor:
    out = ref(*batch)
    opt.zero_grad()
    loss_of(out).backward()
    opt.step()
    return out.detach()


@pytest.mark.parametrize("staging", ["worker", "direct"])
@pytest.mark.parametrize("depth", [1, 2])
def test_one_authoritative_copy_and_no_lost_update_while_staging_ahead(depth, staging):
    """Invariants 1-2: with rows staged up to `depth` batches ahead, also while a batch trains,
    every resident row's slot holds its latest value and the host store every other row's
    (`staging="direct"`: the staging stream reads and writes the pinned host rows itself)."""
    tables, config, cached, ref, opt = _setup(
        capacity=12, depth=depth, device=DEVICE, staging=staging
    )
    (engine,) = cached.engines
    batches = make_batches(tables, batch_size=3, num_batches=30, max_len=3, seed=1)
    res = engine.scheduler.residency
    enqueued = 0
    for t, batch in enumerate(batches):
        while enqueued < len(batches) and enqueued <= t + config.lookahead:
            cached.enqueue(*to_device(batches[enqueued], DEVICE))
            enqueued += 1
        cached.prefetch()
        out = cached(*to_device(batch, DEVICE))
        cached.prefetch()  # the next rows move while this batch trains
        loss_of(out).backward()
        expected_out = _reference_step(ref, opt, batch)
        _settle(engine)
        assert torch.equal(out.detach().cpu(), expected_out), f"step {t}"
        expected = ref.bags[0].weight.data
        slots = res.resident_slots().cpu()
        rows = res.row_of.cpu()[slots]
        assert torch.equal(engine.weights.cpu()[slots], expected[rows]), f"step {t}"
        others = torch.ones(ROWS, dtype=torch.bool)
        others[rows] = False
        assert torch.equal(engine.store.weights[others], expected[others]), f"step {t}"
    stats = engine.stats()
    assert stats.writebacks > 0 and stats.critical_misses == 0
