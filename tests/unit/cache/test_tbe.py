"""FBGEMM's TBE over the cache's slots (`CacheConfig.kernel='fbgemm'`) against the torch kernel,
step by step: the same outputs, rows and optimizer state; when it serves; its storage.

Bitwise where the arithmetic is exact (SGD, integer rows and per-id weights, sum pooling, lr 1),
within float tolerance otherwise: FBGEMM sums a row's gradient over the batch, then applies the
optimizer once, and rounds `lr * g / d` where torch rounds `lr * (g / d)`.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from distcache import CacheConfig, CachedEmbeddingBags, CachedEmbeddings, DistcacheConfigError
from distcache.cache import tbe
from distcache.cache.engine import CacheEngine
from tests.unit.cache.reference import integer_weights, loss_of, make_batches, make_tables

CPU = torch.device("cpu")


def train_two(
    tables, config, batches, weights, *, fmap=None, id_weights=None, module=None, device=CPU
):
    """The same training on both kernels, side by side: returns the two modules (FBGEMM's,
    torch's) and each step's two outputs (on the CPU)."""
    module = module or CachedEmbeddingBags
    pair = []
    for kernel in ("fbgemm", "torch"):
        config_k = dataclasses.replace(config, kernel=kernel)
        cached = module(tables, config_k, feature_table_map=fmap, device=device)
        for t, w in zip(tables, weights, strict=True):
            cached.load_table_weight(t.name, w)
        pair.append(cached)
    on_device = [(v.to(device), o.to(device)) for v, o in batches]
    outs = []
    enqueued = 0
    for step, batch in enumerate(on_device):
        while enqueued < len(batches) and enqueued <= step + config.lookahead:
            for cached in pair:
                cached.enqueue(*on_device[enqueued])
            enqueued += 1
        step_outs = []
        for cached in pair:
            cached.prefetch()
            extra = () if id_weights is None else (id_weights[step].to(device),)
            out = cached(*batch, *extra)
            loss_of(out).backward()
            step_outs.append(out.detach().cpu())
        outs.append(step_outs)
    return pair, outs


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_tbe_trains_as_the_torch_kernel(optimizer, dtype, pooling, weighted):
    check_bags_kernels_agree(optimizer, dtype, pooling, weighted)


def check_bags_kernels_agree(optimizer, dtype, pooling, weighted, device=CPU):
    """Three tables of two widths (so a group has only some features: padded ids), four
    features, two of them sharing a table; a cache that evicts and writes back."""
    tables = [
        dataclasses.replace(t, dtype=dtype)
        for t in make_tables([4, 8, 4], [60, 40, 50], [pooling, "sum", pooling])
    ]
    fmap = [0, 1, 2, 0]
    feature_tables = [tables[t] for t in fmap]
    batches = make_batches(feature_tables, batch_size=3, num_batches=25, max_len=3, seed=3)
    gen = torch.Generator().manual_seed(4)
    id_weights = None
    if weighted:
        id_weights = [torch.randint(1, 4, (v.numel(),), generator=gen).float() for v, _ in batches]
    exact = optimizer == "sgd" and pooling == "sum"
    lr = 1.0 if exact else 0.05
    weights = [w if exact else w / 8 for w in integer_weights(tables, 5)]
    config = CacheConfig(
        capacity=20, lookahead=3, prefetch_depth=1, optimizer=optimizer, learning_rate=lr,
        eps=1e-6,
    )  # fmt: skip
    (fused, plain), outs = train_two(
        tables, config, batches, weights, fmap=fmap, id_weights=id_weights, device=device
    )
    assert [e.kernel for e in fused.engines] == ["fbgemm", "fbgemm"]
    assert [e.kernel for e in plain.engines] == ["torch", "torch"]
    tol = _TOLERANCE[dtype]
    for step, (a, b) in enumerate(outs):
        if exact:
            assert torch.equal(a, b), f"step {step}"
        else:
            torch.testing.assert_close(a, b, **tol, msg=lambda m, s=step: f"step {s}: {m}")
    for t in tables:
        a, b = fused.table_weight(t.name), plain.table_weight(t.name)
        assert a.dtype == dtype
        if exact:
            assert torch.equal(a, b), t.name
        else:
            torch.testing.assert_close(a.float(), b.float(), **tol)
        torch.testing.assert_close(fused.table_state(t.name), plain.table_state(t.name), **tol)
    assert all(s.writebacks > 0 for s in fused.stats().values())


_TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
}


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("padded", [False, True])
def test_tbe_per_id_rows_train_as_the_torch_kernel(optimizer, padded):
    check_rows_kernels_agree(optimizer, padded)


def check_rows_kernels_agree(optimizer, padded, device=CPU):
    """`CachedEmbeddings` (FBGEMM's `PoolingMode.NONE`); `padded`: jagged batches under
    CUDA graphs (emulated on the CPU), padded past their ids."""
    tables = make_tables([8, 8], [50, 30])
    batches = make_batches(tables, batch_size=3, num_batches=20, max_len=4, seed=2)
    exact = optimizer == "sgd"
    config = CacheConfig(
        capacity=18, lookahead=3, prefetch_depth=1, optimizer=optimizer,
        learning_rate=1.0 if exact else 0.05, eps=1e-6, cuda_graphs=padded,
    )  # fmt: skip
    weights = [w if exact else w / 8 for w in integer_weights(tables, 3)]
    (fused, plain), outs = train_two(
        tables, config, batches, weights, module=CachedEmbeddings, device=device
    )
    assert fused.engines[0].kernel == "fbgemm" and plain.engines[0].kernel == "torch"
    check = torch.equal if exact else torch.allclose
    assert all(check(a, b) for a, b in outs)
    for t in tables:
        assert check(fused.table_weight(t.name), plain.table_weight(t.name)), t.name
        assert check(fused.table_state(t.name), plain.table_state(t.name)), t.name
    if padded:
        assert fused.engines[0].stats().graph_replays > 0


def test_a_changed_learning_rate_reaches_the_tbe():
    """The sharding kernel sets `engine.optimizer.lr` (TorchRec's schedulers): the TBE
    applies the rate of the step's lookup."""
    tables = make_tables([4], [40])
    batches = make_batches(tables, batch_size=3, num_batches=12, max_len=3, seed=6)
    config = CacheConfig(capacity=40, lookahead=2, learning_rate=1.0)
    pair = [CachedEmbeddingBags(tables, dataclasses.replace(config, kernel=k)) for k in
            ("fbgemm", "torch")]  # fmt: skip
    for step, batch in enumerate(batches):
        for cached in pair:
            for engine in cached.engines:
                engine.optimizer.lr = 2.0 ** -(step % 4)
            loss_of(cached(*batch)).backward()
    assert torch.equal(pair[0].table_weight("t0"), pair[1].table_weight("t0"))
    assert pair[0].engines[0].tbe.module.get_learning_rate() == 2.0**-3


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad"])
def test_the_cache_is_the_tbe_storage(optimizer):
    """`weights` and `state` view FBGEMM's tensors: a row staged into a slot is what the TBE
    reads, its update is what the stager writes back; the sentinel slot stays zero."""
    config = CacheConfig(capacity=10, optimizer=optimizer, learning_rate=0.5, kernel="fbgemm")
    engine = CacheEngine(num_rows=30, dim=8, config=config)
    module = engine.tbe.module
    assert engine.weights.shape == (12, 8)
    assert engine.weights.data_ptr() == module.weights_host.data_ptr()
    state_dim = {"sgd": 0, "rowwise_adagrad": 1, "adagrad": 8}[optimizer]
    assert engine.state.shape == (12, state_dim)
    if state_dim:
        assert engine.state.data_ptr() == module.momentum1_host.data_ptr()
    engine.weights.copy_(torch.arange(96.0).view(12, 8))
    engine.weights[10].zero_()  # the sentinel slot
    slots, offsets = torch.tensor([1, 3, 1, 10]), torch.tensor([0, 2, 4])
    out = engine.tbe.lookup(slots, offsets)
    torch.testing.assert_close(out, engine.weights[[1, 1]] + engine.weights[[3, 10]])


def test_padding_bags_hold_every_id_and_at_most_32_each():
    offsets = torch.tensor([0, 2, 2, 5])  # 5 ids in bags, then padding up to 100
    covered = tbe._cover(offsets, 100)
    assert covered[: offsets.numel()].tolist() == offsets.tolist()
    sizes = covered.diff()[offsets.numel() - 1 :]
    assert covered[-1] == 100 and sizes.min() >= 0 and sizes.max() <= tbe.PADDING_BAG_IDS
    assert tbe._cover(torch.tensor([0, 3]), 3).tolist() == [0, 3, 3]  # no padding: one empty


@pytest.mark.parametrize(
    ("optimizer", "dim", "dtype", "device", "why"),
    [
        ("sgd", 8, torch.float32, "cpu", None),
        ("rowwise_adagrad", 4, torch.float16, "cpu", None),
        ("adam", 8, torch.float32, "cpu", "no 'adam'"),
        ("sgd", 6, torch.float32, "cpu", "multiple of 4"),
        ("sgd", 0, torch.float32, "cpu", "multiple of 4"),
        ("sgd", 8, torch.bfloat16, "cpu", "no bfloat16"),
        ("sgd", 8, torch.bfloat16, "cuda", "no bfloat16"),
        ("sgd", 2048, torch.float32, "cuda", "up to 1024"),
    ],
)
def test_which_caches_the_tbe_serves(optimizer, dim, dtype, device, why):
    reason = tbe.tbe_unsupported(
        optimizer=optimizer, dim=dim, dtype=dtype, device=torch.device(device)
    )
    assert (reason is None) if why is None else (why in reason)
    config = CacheConfig(optimizer=optimizer)
    # By default FBGEMM's TBE serves the stateful optimizers on CPU only (the host's cost of
    # its wrapper outweighs a scatter-add, and on CUDA its kernels' savings).
    by_default = why is None and device == "cpu" and optimizer != "sgd"
    expected = "fbgemm" if by_default else "torch"
    assert tbe.kernel_for(config, torch.device(device), dtype, dim) == expected
    assert tbe.kernel_for(dataclasses.replace(config, kernel="torch"), CPU, dtype, dim) == "torch"


def test_fbgemm_where_it_cannot_serve_is_an_error():
    with pytest.raises(DistcacheConfigError, match=r"CacheConfig.kernel='x' is invalid"):
        CacheConfig(kernel="x")
    with pytest.raises(DistcacheConfigError, match=r"kernel='fbgemm' is invalid.*'adam'"):
        CacheConfig(kernel="fbgemm", optimizer="adam")
    with pytest.raises(DistcacheConfigError, match=r"cannot serve 6-wide .* multiple of 4"):
        CacheEngine(num_rows=10, dim=6, config=CacheConfig(kernel="fbgemm"))


def test_without_fbgemm_gpu_the_torch_kernel_serves(monkeypatch):
    monkeypatch.setattr(tbe, "_fbgemm_unavailable", lambda device_type: "not installed")
    tables = make_tables([4], [20])
    cached = CachedEmbeddingBags(tables, CacheConfig(capacity=8, learning_rate=1.0))
    assert cached.engines[0].kernel == "torch" and cached.engines[0].tbe is None
    with pytest.raises(DistcacheConfigError, match="not installed"):
        CachedEmbeddingBags(tables, CacheConfig(kernel="fbgemm"))


def test_the_torch_kernel_never_imports_fbgemm_gpu():
    """In a fresh interpreter: `distcache.cache` and a cache on the torch kernel train
    without loading fbgemm_gpu (a CPU install may lack it)."""
    code = (
        "import sys, torch\n"
        "from distcache import CacheConfig, CachedEmbeddingBags, TableSpec\n"
        "t = [TableSpec(name='t', num_embeddings=10, embedding_dim=4)]\n"
        "m = CachedEmbeddingBags(t, CacheConfig(kernel='torch', capacity=4))\n"
        "m(torch.tensor([1, 2]), torch.tensor([0, 1, 2])).sum().backward()\n"
        "print('fbgemm_gpu' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_stochastic_rounding_asked_for_on_cpu_keeps_half_rows_on_the_torch_kernel():
    """FBGEMM's CPU kernels round half rows to nearest: asked for stochastic rounding, the
    default is the torch kernel, and kernel='fbgemm' is refused naming why."""
    cpu, half = torch.device("cpu"), torch.float16
    config = CacheConfig(optimizer="rowwise_adagrad", stochastic_rounding=True)
    assert tbe.kernel_for(config, cpu, half, 8) == "torch"
    assert tbe.kernel_for(config, cpu, torch.float32, 8) == "fbgemm"  # fp32 rows: no rounding
    assert tbe.kernel_for(CacheConfig(optimizer="rowwise_adagrad"), cpu, half, 8) == "fbgemm"
    forced = dataclasses.replace(config, kernel="fbgemm")
    with pytest.raises(DistcacheConfigError, match="round half rows to nearest"):
        tbe.kernel_for(forced, cpu, half, 8)
