"""TorchRec's pipelines that need streams, on CPU, their streams emulated, for the tests.

TorchRec's prefetch pipeline (`PrefetchTrainPipelineSparseDist`, its answer for tables behind
FBGEMM's UVM cache) prefetches batch i + 1's rows through the sharded modules' `prefetch`,
between batch i's forward and its backward, on a stream of its own. On CPU it has no streams,
and then prefetches nothing: its forward refuses the batch ("Invalid PrefetchPipelinedForward
usage"), with TorchRec's own kernels too. Here its streams are `torch.cpu` streams (no-ops, one
device), so that its stages run on CPU in the order they run on a GPU: what distcache's caches
see of it is the same. `TrainPipelineSemiSync` gets the same treatment.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torchrec.distributed.train_pipeline import PrefetchTrainPipelineSparseDist
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSemiSync


class _CpuStream(torch.cpu.Stream):
    """A `torch.cpu` stream with the `device` TorchRec's pipelined forwards read."""

    device = torch.device("cpu")


class _CpuStreams:
    """Mixed in before a TorchRec pipeline: its data-dist, prefetch and default streams are
    CPU streams, and `progress` runs within `cpu_record_stream`."""

    _STREAMS = ("_data_dist_stream", "_prefetch_stream", "_default_stream")

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **kwargs):  # noqa: ANN003
        super().__init__(model, optimizer, torch.device("cpu"), **kwargs)
        for name in self._STREAMS:
            if hasattr(self, name):
                setattr(self, name, _CpuStream())
        self._stream_context = torch.cpu.stream

    def progress(self, dataloader_iter):  # noqa: ANN001, ANN201
        with cpu_record_stream():
            return super().progress(dataloader_iter)


class CpuPrefetchPipeline(_CpuStreams, PrefetchTrainPipelineSparseDist):
    """`PrefetchTrainPipelineSparseDist` on CPU streams."""


class CpuSemiSyncPipeline(_CpuStreams, TrainPipelineSemiSync):
    """`TrainPipelineSemiSync` on CPU streams (its `start_batch` a keyword argument)."""


def idle_optimizer() -> torch.optim.Optimizer:
    """What TorchRec's pipelines step for a model with no dense parameter: an optimizer of
    one parameter of nothing."""
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)


@contextlib.contextmanager
def cpu_record_stream() -> Iterator[None]:
    """Within it, `record_stream` of a CPU tensor does nothing (what it means on one stream);
    torch refuses a CPU stream there."""
    real = torch.Tensor.record_stream

    def record_stream(tensor: torch.Tensor, stream: torch.Stream) -> None:
        if tensor.device.type != "cpu":
            real(tensor, stream)

    torch.Tensor.record_stream = record_stream
    try:
        yield
    finally:
        torch.Tensor.record_stream = real
