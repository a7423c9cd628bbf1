"""Hot rows (`distcache.sharding.hot_rows`) on CUDA, one process: split, pooling, backward and
the update give what the same steps give on the CPU, both reductions ('all', 'touched').

TorchRec is needed (the batch is a `KeyedJaggedTensor`); the GPU machine's FBGEMM has CPU ops
only, so the batch is built with its offsets given (nothing of FBGEMM's runs on it).
"""

import pytest
import torch

from distcache.cache.config import CacheConfig
from tests.gpu.common import CUDA_REASON

DEVICE = torch.device("cuda")
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason=CUDA_REASON
)
HOT = {"a": (3, 7, 40), "b": (0, 7, 9), "c": (5, 6)}  # table -> its hot rows
DIMS = {"a": 4, "b": 4, "c": 8}  # two widths


def _train(device: torch.device, reduce: str, steps: int = 3) -> list[torch.Tensor]:
    pytest.importorskip("torchrec")
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from distcache.sharding.hot_rows import HotRows

    tables = {
        t: (50, DIMS[t], CacheConfig(hot_rows=rows, hot_reduce=reduce, optimizer="adagrad"))
        for t, rows in HOT.items()
    }
    hot = HotRows(tables, {"fa": "a", "fb": "b", "fc": "c"}, set(), device)
    hot.stale = False
    hot.flat.copy_(torch.arange(hot.flat.numel(), dtype=torch.float32) % 7)
    gen = torch.Generator().manual_seed(0)
    outs = []
    for _ in range(steps):
        lengths = torch.randint(0, 4, (3 * 4,), generator=gen)  # 3 features, B = 4
        values = torch.randint(0, 12, (int(lengths.sum()),), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        kjt = KeyedJaggedTensor(
            keys=["fa", "fb", "fc"],
            values=values.to(device),
            lengths=lengths.to(device),
            offsets=offsets.to(device),
        )
        _, part = hot.split(kjt)
        pooled = hot.pooled(part)
        outs += [v.detach().cpu() for v in pooled.values()]
        sum((v * (k + 1)).sum() for k, v in enumerate(pooled.values())).backward()
    hot.finish_step()
    return [*outs, hot.flat.cpu(), *(w.state.cpu() for w in hot.widths)]


@pytest.mark.parametrize("reduce", ["all", "touched"])
def test_hot_rows_on_cuda_train_as_on_the_cpu(reduce):
    for got, want in zip(_train(DEVICE, reduce), _train(torch.device("cpu"), reduce), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduce", ["all", "touched"])
def test_sequence_hot_rows_on_cuda_train_as_on_the_cpu(reduce):
    """Per-id outputs (`EmbeddingCollection`): the replica's rows put back among the cold ids'
    rows (`PlaceRows`), the gradients and the step, on CUDA as on the CPU."""
    pytest.importorskip("torchrec")
    from tests.unit.sharding.test_hot_rows import sequence_step

    cuda, cpu = sequence_step(DEVICE, reduce), sequence_step("cpu", reduce)
    for got, want in zip(cuda, cpu, strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)
