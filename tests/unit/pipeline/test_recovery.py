"""After a failed `progress`, a new `LookaheadTrainPipeline` on the same model goes on training
without reloading its weights, and ends where training that never saw the bad batch ends:
the failed step applied nothing and the batches routed after it were dropped, not trained."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from distcache import CacheConfig, InvalidBatchError, InvalidIdError, LookaheadWindowError
from distcache.pipeline import LookaheadTrainPipeline
from distcache.sharding import CachedEmbeddingBagCollectionSharder
from distcache.sharding.sharded_module import ShardedCachedEmbeddingBagCollection
from tests.distributed.pipeline_sweep_case import EbcTrain, sweep_batches
from tests.distributed.sharded_model import integer_init, make_ebc, per_table_plan, plan_for
from tests.unit.pipeline.test_lookahead import one_rank  # noqa: F401 (fixture)

BAD = 4  # the batch with an out-of-range id


def _batches() -> list[Batch]:
    out = []
    for k, kjt in enumerate(sweep_batches(10, 1, 9)):
        if k == BAD:
            values = kjt.values().clone()
            values[0] = 10_000
            kjt = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), values, kjt.lengths())
        b = kjt.stride()
        out.append(
            Batch(dense_features=torch.zeros(b, 1), sparse_features=kjt, labels=torch.zeros(b))
        )
    return out


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    ebc = make_ebc()
    integer_init(ebc)
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 1.0})
    sharder = CachedEmbeddingBagCollectionSharder(CacheConfig(capacity=0.5, lookahead=3))
    plan = plan_for("table_wise", 1)
    return per_table_plan(EbcTrain(ebc), "ebc", ebc, plan, sharder, init_data_parallel=False)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: torch.cat([s.tensor for s in v.local_shards()])
        for k, v in model.state_dict().items()
        if hasattr(v, "local_shards")
    }


def _enqueued(model: torch.nn.Module) -> int:
    return sum(
        kernel.bags.num_enqueued
        for m in model.modules()
        if isinstance(m, ShardedCachedEmbeddingBagCollection)
        for kernel in m.cached_kernels()
    )


def rest_of(batches: list[Batch]) -> list[Batch]:
    return batches[BAD + 1 :]


def _train(pipeline: LookaheadTrainPipeline, batches: Iterator[Batch]) -> int:
    trained = 0
    while True:
        try:
            pipeline.progress(batches)
        except StopIteration:
            return trained
        trained += 1


@pytest.mark.parametrize("how", ["new pipeline", "close", "abandoned"])
def test_training_goes_on_after_a_bad_batch(one_rank: None, how: str) -> None:  # noqa: F811
    batches = _batches()
    reference = _model()
    good = [b for k, b in enumerate(batches) if k != BAD]
    assert _train(LookaheadTrainPipeline(reference, None, "cpu"), iter(good)) == len(good)

    model = _model()
    pipeline = LookaheadTrainPipeline(model, None, "cpu")
    it = iter(batches)
    if how == "abandoned":  # trained up to the bad batch, then left with a full window
        for _ in range(BAD):
            pipeline.progress(it)
        rest = iter(rest_of(batches))
        assert _train(LookaheadTrainPipeline(model, None, "cpu"), rest) == len(rest_of(batches))
        for name, weight in _weights(reference).items():
            assert torch.equal(_weights(model)[name], weight), name
        return
    with pytest.raises(InvalidIdError):
        _train(pipeline, it)
    with pytest.raises(LookaheadWindowError, match="closed"):
        pipeline.progress(it)
    if how == "close":
        pipeline.close()
        with pytest.raises(LookaheadWindowError, match="closed"):
            pipeline.progress(it)
    # The batches after the bad one were read from the loader but not trained: feed them again.
    rest = iter(rest_of(batches))
    assert _train(LookaheadTrainPipeline(model, None, "cpu"), rest) == len(rest_of(batches))
    for name, weight in _weights(reference).items():
        assert torch.equal(_weights(model)[name], weight), name


def test_training_goes_on_after_the_loader_fails(one_rank: None) -> None:  # noqa: F811
    good = [b for k, b in enumerate(_batches()) if k != BAD]
    reference = _model()
    _train(LookaheadTrainPipeline(reference, None, "cpu"), iter(good))

    def failing_loader() -> Iterator[Batch]:
        yield from good[:6]
        raise OSError("the data file went away")

    model = _model()
    pipeline = LookaheadTrainPipeline(model, None, "cpu")
    loader, trained = failing_loader(), 0
    with pytest.raises(OSError, match="went away"):
        while True:
            pipeline.progress(loader)
            trained += 1
    assert 0 < trained < 6  # batches were in the window, read and routed but not trained
    assert _enqueued(model) == 0  # the failed progress dropped them from every cache
    assert _train(LookaheadTrainPipeline(model, None, "cpu"), iter(good[trained:])) > 0
    for name, weight in _weights(reference).items():
        assert torch.equal(_weights(model)[name], weight), name


def _malformed(kind: str, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    keys, values, lengths = kjt.keys(), kjt.values(), kjt.lengths()
    if kind == "missing feature":
        n = len(keys) - 1  # drop the last feature's bags and ids
        stride = kjt.stride()
        kept = lengths[: n * stride]
        return KeyedJaggedTensor(keys[:n], values[: int(kept.sum())], lengths=kept)
    if kind == "float ids":
        return KeyedJaggedTensor(keys, values.float(), lengths=lengths)
    if kind == "variable batch":  # the first feature without its last bag
        stride = kjt.stride()
        start, dropped = int(lengths[: stride - 1].sum()), int(lengths[stride - 1])
        return KeyedJaggedTensor(
            keys,
            torch.cat([values[:start], values[start + dropped :]]),
            lengths=torch.cat([lengths[: stride - 1], lengths[stride:]]),
            stride_per_key_per_rank=[[stride - 1]] + [[stride]] * (len(keys) - 1),
        )
    bad = lengths.clone()
    bad[0] += 3  # lengths that add up to more ids than the batch holds
    return KeyedJaggedTensor(keys, values, lengths=bad)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing feature", r"lacks feature\(s\) \['f"),
        ("float ids", "ids are torch.float32: ids must be torch.int64 or torch.int32"),
        ("variable batch", r"batch sizes \{'f0': \d+, 'f1': \d+.*need one batch size"),
        ("bad lengths", r"lengths add up to \d+ ids but it holds \d+ ids"),
    ],
)
def test_a_malformed_batch_is_named_and_training_goes_on(
    one_rank: None,  # noqa: F811
    kind: str,
    message: str,
) -> None:
    good = [b for k, b in enumerate(_batches()) if k != BAD]
    reference = _model()
    _train(LookaheadTrainPipeline(reference, None, "cpu"), iter(good))

    batches = list(good)
    bad = batches[BAD]
    batches.insert(BAD, replace(bad, sparse_features=_malformed(kind, bad.sparse_features)))
    model = _model()
    pipeline, it, trained = LookaheadTrainPipeline(model, None, "cpu"), iter(batches), 0
    with pytest.raises(InvalidBatchError, match=message):
        while True:
            pipeline.progress(it)
            trained += 1
    assert trained < BAD and _enqueued(model) == 0  # refused when it entered the window
    rest = [b for k, b in enumerate(batches) if k >= trained and k != BAD]
    _train(LookaheadTrainPipeline(model, None, "cpu"), iter(rest))
    for name, weight in _weights(reference).items():
        assert torch.equal(_weights(model)[name], weight), name


class _NanLossOnNanDense(EbcTrain):
    """The loss picks up the batch's dense features: NaN for a batch that holds a NaN."""

    def forward(self, batch: Batch):  # noqa: ANN201
        loss, out = super().forward(batch)
        return loss + batch.dense_features.sum(), out


@pytest.mark.parametrize("skip", [True, False])
def test_skip_nonfinite_skips_the_step_and_nothing_else(one_rank: None, skip: bool) -> None:  # noqa: F811
    batches = [b for k, b in enumerate(_batches()) if k != BAD]
    reference = _model()
    _train(LookaheadTrainPipeline(reference, None, "cpu"), iter(batches))
    poisoned = list(batches)
    nan = torch.full_like(poisoned[BAD].dense_features, float("nan"))
    poisoned.insert(BAD, replace(poisoned[BAD], dense_features=nan))
    model = _model()
    model._dmp_wrapped_module.__class__ = _NanLossOnNanDense  # same module, NaN-aware loss
    pipeline = LookaheadTrainPipeline(model, None, "cpu", skip_nonfinite=skip)
    assert _train(pipeline, iter(poisoned)) == len(poisoned)  # every batch passed through
    weights = _weights(model)
    if not skip:  # its rows' gradient is finite here: the batch trained like the others
        assert any(not torch.equal(weights[k], w) for k, w in _weights(reference).items())
        return
    assert pipeline.skipped_nonfinite == 1
    assert pipeline.stats()["total"]["skipped_nonfinite"] == 1
    for name, weight in _weights(reference).items():
        assert torch.equal(weights[name], weight), name
