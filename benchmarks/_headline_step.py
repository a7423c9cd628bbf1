"""The pieces of a `gpu_headline.py` training step that every variant shares: the profiler's
phase markers and the dense part with the backward (embedding rows update inside it, in the
cache's or FBGEMM's fused optimizer)."""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

HOST_S: collections.Counter[str] = collections.Counter()
"""Host wall seconds spent in each phase since it was last cleared (`gpu_headline.measure`
clears it before the timed steps): the host's work, and any wait for the device in the phase."""


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """A `## headline:NAME ##` range for `torch.profiler` (the JSON's phase times), its host
    time added to `HOST_S`."""
    start = time.perf_counter()
    with torch.profiler.record_function(f"## headline:{name} ##"):
        yield
    HOST_S[name] += time.perf_counter() - start


def dense_and_backward(
    t: int,
    pooled: torch.Tensor,
    data,
    dense_model: nn.Module,
    dense_opt,  # noqa: ANN001
) -> torch.Tensor:
    """Batch t's dense part, loss and backward (with the dense SGD step); its loss."""
    with phase("dense"):
        loss = F.binary_cross_entropy_with_logits(
            dense_model(data.dense[t], pooled), data.labels[t]
        )
    with phase("backward"):
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
    return loss.detach()
