"""Training through the cache equals training plain `nn.EmbeddingBag`s (DESIGN invariant 5).

`KERNELS`: the default (FBGEMM's TBE for the tables whose width is a multiple of 4, the torch
kernel for the others) and the torch kernel alone (`CacheConfig.kernel`).
"""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distcache import (
    CacheConfig,
    CachedEmbeddingBags,
    DistcacheConfigError,
    InvalidBatchError,
    InvalidIdError,
    TableSpec,
)
from tests.unit.cache.reference import (
    integer_weights,
    loss_of,
    make_batches,
    make_tables,
    train_both,
    updated_below_half_a_gap,
)

KERNELS = [None, "torch"]


def _check_equal(cached, ref, pairs, tables, *, exact: bool) -> None:
    for step, (out, ref_out) in enumerate(pairs):
        if exact:
            assert torch.equal(out, ref_out), f"output differs at step {step}"
        else:
            torch.testing.assert_close(out, ref_out, msg=lambda m, s=step: f"step {s}: {m}")
    for t, bag in zip(tables, ref.bags, strict=True):
        if exact:
            assert torch.equal(cached.table_weight(t.name), bag.weight.data), t.name
        else:
            torch.testing.assert_close(cached.table_weight(t.name), bag.weight.data)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("policy", ["lookahead", "lru", "lfu"])
@pytest.mark.parametrize("capacity", [24, 0.5, 1.0])
def test_sgd_integer_weights_bitwise(policy, capacity, kernel):
    tables = make_tables([4, 4, 3], [60, 35, 50])
    config = CacheConfig(
        capacity=capacity, lookahead=3, prefetch_depth=1, policy=policy, learning_rate=1.0,
        kernel=kernel,
    )  # fmt: skip
    batches = make_batches(tables, batch_size=3, num_batches=25, max_len=3, seed=1)
    cached, ref, pairs = train_both(tables, config, batches, weights=integer_weights(tables, 0))
    _check_equal(cached, ref, pairs, tables, exact=True)
    stats = cached.stats()
    if capacity == 24:  # small enough that batches evict and write back dirty rows
        assert all(s.evictions > 0 and s.writebacks > 0 for s in stats.values())
    if policy == "lookahead":
        assert all(s.critical_misses == 0 for s in stats.values())
    else:
        assert all(s.critical_misses == s.loads for s in stats.values())


def test_without_window_every_miss_is_critical_and_results_equal():
    tables = make_tables([4, 4], [40, 30])
    config = CacheConfig(capacity=16, lookahead=2, prefetch_depth=1, learning_rate=1.0)
    batches = make_batches(tables, batch_size=2, num_batches=15, max_len=3, seed=2)
    weights = integer_weights(tables, 1)
    cached, ref, pairs = train_both(tables, config, batches, weights=weights, use_window=False)
    _check_equal(cached, ref, pairs, tables, exact=True)
    (stats,) = cached.stats().values()
    assert stats.loads > 0 and stats.critical_misses == stats.loads


def test_tables_of_their_own_capacities_share_one_cache_and_match_the_reference():
    """t1 cached whole beside t0 at 10 % and t2 at 12 rows (`TableSpec.capacity`): one cache of
    their rows together (4 + 30 + 12), whose evictions leave the results exact."""
    tables = make_tables([4, 4, 4], [40, 30, 50])
    tables[1] = dataclasses.replace(tables[1], capacity=1.0)
    tables[2] = dataclasses.replace(tables[2], capacity=12)
    config = CacheConfig(capacity=0.1, lookahead=2, prefetch_depth=1, learning_rate=1.0)
    batches = make_batches(tables, batch_size=2, num_batches=15, max_len=3, seed=2)
    cached, ref, pairs = train_both(tables, config, batches, weights=integer_weights(tables, 1))
    _check_equal(cached, ref, pairs, tables, exact=True)
    (stats,) = cached.stats().values()
    assert stats.capacity == 4 + 30 + 12 and stats.loads > 0
    # An int is rows, a float a fraction, even where they compare equal.
    one_row = [dataclasses.replace(tables[0], capacity=1)]
    (stats,) = CachedEmbeddingBags(one_row, CacheConfig(capacity=1.0)).stats().values()
    assert stats.capacity == 1


@pytest.mark.parametrize("kernel", KERNELS)
def test_mean_pooling_matches_within_tolerance(kernel):
    tables = make_tables([4, 6], [50, 40], ["mean", "sum"])
    config = CacheConfig(
        capacity=20, lookahead=2, prefetch_depth=2, learning_rate=0.5, kernel=kernel
    )
    batches = make_batches(tables, batch_size=4, num_batches=20, max_len=4, seed=3)
    cached, ref, pairs = train_both(tables, config, batches, weights=integer_weights(tables, 2))
    _check_equal(cached, ref, pairs, tables, exact=False)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad", "adam"])
def test_stateful_optimizers_match_torch(optimizer, kernel):
    tables = make_tables([4, 4, 8], [50, 30, 40])
    config = CacheConfig(
        capacity=20,
        lookahead=3,
        prefetch_depth=1,
        optimizer=optimizer,
        learning_rate=0.05,
        eps=1e-6 if optimizer != "adagrad" else 1e-10,
        kernel=kernel,
    )
    batches = make_batches(tables, batch_size=3, num_batches=30, max_len=3, seed=4)
    weights = [w / 8 for w in integer_weights(tables, 3)]
    cached, ref, pairs = train_both(tables, config, batches, weights=weights)
    _check_equal(cached, ref, pairs, tables, exact=False)
    (stats,) = [s for name, s in cached.stats().items() if "t0" in name]
    assert stats.writebacks > 0, "the cache must be small enough to write state back"
    # Optimizer state travelled with its rows through evictions: equal by row position.
    for t, bag in zip(tables, ref.bags, strict=True):
        state = cached.table_state(t.name)
        ref_state = opt_state(ref_opt_of(ref), bag.weight, optimizer)
        torch.testing.assert_close(state, ref_state)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(
    num_tables=st.integers(1, 3),
    policy=st.sampled_from(["lookahead", "lru", "lfu"]),
    lookahead=st.sampled_from([0, 1, 2, 4, 16]),
    depth=st.integers(0, 4),
    capacity_extra=st.integers(0, 30),
    pooling=st.sampled_from(["sum", "mean"]),
    seed=st.integers(0, 1000),
    kernel=st.sampled_from(KERNELS),
)
def test_sweep_equals_reference(
    num_tables, policy, lookahead, depth, capacity_extra, pooling, seed, kernel
):
    depth = min(depth, lookahead)
    tables = make_tables(
        [4] * num_tables, [20 + 7 * i for i in range(num_tables)], [pooling] * num_tables
    )
    batches = make_batches(tables, batch_size=2, num_batches=12, max_len=2, seed=seed)
    # The smallest cache that holds depth + 1 consecutive batches' rows, plus some slack.
    width = depth + 1
    need = 0
    for t in range(len(batches)):
        window = torch.cat([_engine_rows(tables, b) for b in batches[t : t + width]])
        need = max(need, window.unique().numel())
    total = sum(t.num_embeddings for t in tables)
    capacity = max(1, min(total, need + capacity_extra))
    config = CacheConfig(
        capacity=capacity,
        lookahead=lookahead,
        prefetch_depth=depth,
        policy=policy,
        learning_rate=1.0,
        kernel=kernel,
    )
    cached, ref, pairs = train_both(
        tables,
        config,
        batches,
        weights=integer_weights(tables, seed),
    )
    _check_equal(cached, ref, pairs, tables, exact=pooling == "sum")
    for s in cached.stats().values():
        if policy == "lookahead" and depth > 0:
            assert s.critical_misses == 0
        assert s.batches == len(batches)


def ref_opt_of(ref):
    return ref.optimizer


def opt_state(opt, param, optimizer):
    """The reference optimizer's per-row state in distcache's column layout."""
    state = opt.state[param]
    if optimizer == "adagrad":
        return state["sum"]
    if optimizer == "rowwise_adagrad":
        return state["sum"]
    return torch.cat([state["exp_avg"], state["exp_avg_sq"]], dim=1)


def _engine_rows(tables, batch):
    values, offsets = batch
    batch_size = (offsets.numel() - 1) // len(tables)
    rows, base = [], 0
    for k, t in enumerate(tables):
        lo, hi = int(offsets[k * batch_size]), int(offsets[(k + 1) * batch_size])
        rows.append(values[lo:hi] + base)
        base += t.num_embeddings
    return torch.cat(rows)


def test_eval_mode_reads_without_updating_or_dirtying():
    tables = make_tables([4], [30])
    cached = CachedEmbeddingBags(tables, CacheConfig(capacity=8, learning_rate=1.0))
    before = cached.table_weight("t0").clone()
    batches = make_batches(tables, batch_size=3, num_batches=10, max_len=3, seed=6)
    cached.eval()
    for b in batches:
        out = cached(*b)
        assert not out.requires_grad
    assert torch.equal(cached.table_weight("t0"), before)
    (stats,) = cached.stats().values()
    assert stats.loads > 0 and stats.writebacks == 0  # clean rows are never written back


@pytest.mark.parametrize(
    ("kernel", "sequence", "settings"),
    [
        ("fbgemm", False, {}),
        ("torch", False, {}),
        ("fbgemm", True, {}),
        ("torch", True, {}),
        ("torch", False, {"scheduler_thread": True}),  # the scheduling on a thread of its own
        ("torch", False, {"staging": "direct"}),  # copies bounded on the device
    ],
)
def test_evaluations_and_a_load_between_steps_keep_the_window(kernel, sequence, settings):
    """Between two training steps, with batches enqueued and staged ahead (as between
    `LookaheadTrainPipeline.progress` calls), an evaluation (eval mode, no gradient) of other
    batches, and of the next batch itself, reads the rows as trained so far: bitwise the
    reference's outputs, rows evicted, dirty and staged ahead among them. A load of new
    weights empties the caches and keeps the enqueued batches, staged anew. Training goes on
    bitwise the reference's, with no critical-path miss. Pooled bags (two caches: two widths)
    and `sequence`, per-id rows (`CachedEmbeddings`, one width)."""
    tables = make_tables([4, 4, 4 if sequence else 8], [60, 35, 50])
    config = CacheConfig(
        capacity=12, lookahead=3, prefetch_depth=1, learning_rate=1.0, kernel=kernel, **settings
    )
    batches = make_batches(tables, batch_size=3, num_batches=16, max_len=3, seed=2)
    others = make_batches(tables, batch_size=4, num_batches=3, max_len=3, seed=9)
    evaluate = {2: others[0], 6: batches[7], 11: others[1], 12: others[2]}
    load = {8: integer_weights(tables, 5)}
    cached, ref, pairs = train_both(
        tables, config, batches, weights=integer_weights(tables, 0), sequence=sequence,
        evaluate=evaluate, load=load,
    )  # fmt: skip
    assert len(pairs) == len(batches) + len(evaluate)
    for step, (out, ref_out) in enumerate(pairs):
        assert torch.equal(out, ref_out), f"output {step}"
    for t, module in zip(tables, ref.embs if sequence else ref.bags, strict=True):
        assert torch.equal(cached.table_weight(t.name), module.weight.data), t.name
    assert all(s.critical_misses == 0 and s.evictions > 0 for s in cached.stats().values())


def test_an_evaluations_invalid_id_is_named_and_the_window_kept():
    tables = make_tables([4], [30])
    cached = CachedEmbeddingBags(tables, CacheConfig(capacity=12, lookahead=2))
    b1, b2 = make_batches(tables, batch_size=3, num_batches=2, max_len=2, seed=4)
    cached.enqueue(*b1)
    cached.enqueue(*b2)
    cached.eval()
    with pytest.raises(InvalidIdError, match="30"):
        cached(torch.tensor([3, 30]), torch.tensor([0, 1, 2]))
    cached.train()
    assert cached.num_enqueued == 2
    for batch in (b1, b2):
        loss_of(cached(*batch)).backward()


def test_backward_after_next_forward_is_refused():
    tables = make_tables([4], [30])
    cached = CachedEmbeddingBags(tables, CacheConfig(capacity=30))
    b1, b2 = make_batches(tables, batch_size=2, num_batches=2, max_len=2, seed=7)
    out1 = cached(*b1)
    cached(*b2)
    with pytest.raises(RuntimeError, match="run backward before the next forward"):
        loss_of(out1).backward()


@pytest.mark.parametrize("kernel", KERNELS)
def test_features_sharing_a_table_match_reference(kernel):
    """Two features look up table t0 (TorchRec's shared tables): updates from both accumulate."""
    tables = make_tables([4, 4], [40, 30])
    fmap = [0, 1, 0]
    weights = integer_weights(tables, 9)
    config = CacheConfig(
        capacity=15, lookahead=2, prefetch_depth=1, learning_rate=1.0, kernel=kernel
    )
    cached = CachedEmbeddingBags(tables, config, feature_table_map=fmap)
    for t, w in zip(tables, weights, strict=True):
        cached.load_table_weight(t.name, w)
    bags = [
        torch.nn.EmbeddingBag(40, 4, mode="sum", sparse=True),
        torch.nn.EmbeddingBag(30, 4, mode="sum", sparse=True),
    ]
    for bag, w in zip(bags, weights, strict=True):
        bag.weight.data.copy_(w)
    opt = torch.optim.SGD([b.weight for b in bags], lr=1.0)
    feature_tables = [tables[t] for t in fmap]
    batches = make_batches(feature_tables, batch_size=3, num_batches=15, max_len=3, seed=10)
    for values, offsets in batches:
        out = cached(values, offsets)
        loss_of(out).backward()
        ref = []
        for k, t in enumerate(fmap):
            lo, hi = int(offsets[k * 3]), int(offsets[(k + 1) * 3])
            ref.append(bags[t](values[lo:hi], offsets[k * 3 : (k + 1) * 3] - lo))
        ref_out = torch.cat(ref, 1)
        opt.zero_grad()
        loss_of(ref_out).backward()
        opt.step()
        assert torch.equal(out.detach(), ref_out.detach())
    for t, bag in zip(tables, bags, strict=True):
        assert torch.equal(cached.table_weight(t.name), bag.weight.data)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_rows_integer_weights_bitwise(dtype, kernel):
    """Half rows hold small integers exactly: training equals fp32 `nn.EmbeddingBag`s bitwise,
    through evictions and write-backs, and the rows stay half in the store and the cache."""
    tables = [dataclasses.replace(t, dtype=dtype) for t in make_tables([4, 4, 3], [60, 35, 50])]
    config = CacheConfig(
        capacity=24, lookahead=3, prefetch_depth=1, learning_rate=1.0, kernel=kernel
    )
    batches = make_batches(tables, batch_size=3, num_batches=25, max_len=3, seed=1)
    cached, ref, pairs = train_both(tables, config, batches, weights=integer_weights(tables, 0))
    for out, ref_out in pairs:
        assert out.dtype == torch.float32 and torch.equal(out, ref_out)
    for t, bag in zip(tables, ref.bags, strict=True):
        weight = cached.table_weight(t.name)
        assert weight.dtype == dtype and torch.equal(weight.float(), bag.weight.data), t.name
    for engine in cached.engines:
        assert engine.weights.dtype == dtype and engine.store.weights.dtype == dtype
        stats = engine.stats()
        assert stats.writebacks > 0 and stats.bytes_loaded == stats.loads * engine.dim * 2


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_half_rows_train_as_fp32_rows_within_half_rounding(optimizer, kernel):
    """Real-valued rows: fp16 tables track fp32 ones within fp16 rounding (the update is
    computed in fp32 and rounded to nearest once per step); the state stays fp32."""
    tables = make_tables([4, 8], [50, 40])
    half = [dataclasses.replace(t, dtype=torch.float16) for t in tables]
    config = CacheConfig(
        capacity=20, lookahead=3, prefetch_depth=1, optimizer=optimizer, learning_rate=0.01,
        kernel=kernel,
    )  # fmt: skip
    batches = make_batches(tables, batch_size=3, num_batches=30, max_len=3, seed=4)
    weights = [(w / 8).half().float() for w in integer_weights(tables, 3)]  # fp16-exact start
    full, _, _ = train_both(tables, config, batches, weights=weights)
    cached, _, _ = train_both(half, config, batches, weights=weights)
    for t in tables:
        torch.testing.assert_close(
            cached.table_weight(t.name).float(), full.table_weight(t.name), atol=4e-3, rtol=4e-3
        )
        assert cached.table_state(t.name).dtype == torch.float32
    assert any(not torch.equal(cached.table_weight(t.name).float(), full.table_weight(t.name))
               for t in tables)  # fmt: skip


def test_an_unsupported_row_dtype_is_named():
    with pytest.raises(DistcacheConfigError, match=r"table 't': dtype=torch.float64 is invalid"):
        TableSpec(name="t", num_embeddings=3, embedding_dim=2, dtype=torch.float64)


def _weighted_reference(tables, weights, batches, id_weights, lr):
    """Uncached `nn.EmbeddingBag`s (sum) with per-sample weights and SGD; mean bags divide the
    weighted sum by their number of ids (FBGEMM's weighted mean). Returns outputs and rows."""
    bags = [torch.nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode="sum") for t in tables]
    for bag, w in zip(bags, weights, strict=True):
        bag.weight.data.copy_(w)
    opt = torch.optim.SGD([b.weight for b in bags], lr=lr)
    outs = []
    for (values, offsets), per_id in zip(batches, id_weights, strict=True):
        b = (offsets.numel() - 1) // len(tables)
        parts = []
        for k, (t, bag) in enumerate(zip(tables, bags, strict=True)):
            lo, hi = int(offsets[k * b]), int(offsets[(k + 1) * b])
            off = offsets[k * b : (k + 1) * b + 1] - lo
            out = bag(values[lo:hi], off[:-1], per_sample_weights=per_id[lo:hi])
            if t.pooling == "mean":
                out = out / off.diff().clamp(min=1).unsqueeze(1)
            parts.append(out)
        out = torch.cat(parts, dim=1)
        opt.zero_grad()
        loss_of(out).backward()
        opt.step()
        outs.append(out.detach())
    return outs, [b.weight.detach() for b in bags]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_weighted_features_equal_per_sample_weighted_bags(pooling, kernel):
    """Integer rows and integer per-id weights, SGD: bitwise for sum bags (mean: within
    rounding), through evictions, with groups that pack some of the features."""
    tables = make_tables([4, 4, 3], [60, 35, 50], [pooling, "sum", pooling])
    config = CacheConfig(
        capacity=24, lookahead=3, prefetch_depth=1, learning_rate=1.0, kernel=kernel
    )
    batches = make_batches(tables, batch_size=3, num_batches=20, max_len=3, seed=6)
    gen = torch.Generator().manual_seed(7)
    id_weights = [torch.randint(1, 4, (v.numel(),), generator=gen).float() for v, _ in batches]
    weights = integer_weights(tables, 5)
    ref_outs, ref_rows = _weighted_reference(tables, weights, batches, id_weights, lr=1.0)
    cached = CachedEmbeddingBags(tables, config)
    for t, w in zip(tables, weights, strict=True):
        cached.load_table_weight(t.name, w)
    enqueued = 0
    for step, ((values, offsets), per_id) in enumerate(zip(batches, id_weights, strict=True)):
        while enqueued < len(batches) and enqueued <= step + config.lookahead:
            cached.enqueue(*batches[enqueued])
            enqueued += 1
        cached.prefetch()
        out = cached(values, offsets, per_id)
        loss_of(out).backward()
        check = torch.equal if pooling == "sum" else torch.allclose
        assert check(out.detach(), ref_outs[step]), step
    for t, rows in zip(tables, ref_rows, strict=True):
        check = torch.equal if pooling == "sum" else torch.allclose
        assert check(cached.table_weight(t.name), rows), t.name
    assert all(s.writebacks > 0 for s in cached.stats().values())


def test_weights_of_the_wrong_length_are_refused():
    tables = make_tables([4], [10])
    cached = CachedEmbeddingBags(tables, CacheConfig(capacity=1.0))
    values, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3])
    with pytest.raises(InvalidBatchError, match=r"holds 2 torch.float32 values for 3 ids"):
        cached(values, offsets, torch.ones(2))
    assert cached.num_enqueued == 0  # refused before it entered the window
    assert torch.equal(cached(values, offsets, torch.ones(3)), cached(values, offsets))


class _DenseReference:
    """The tables as dense rows of their dtype, trained with the optimizer's formula written
    out (lazily: only the rows a batch uses, each with its gradient summed over the batch),
    computed in float32 and rounded to nearest into the rows' dtype."""

    def __init__(self, tables, weights, fmap, config):
        self.tables, self.fmap, self.config = tables, fmap, config
        self.rows = [w.to(t.dtype) for t, w in zip(tables, weights, strict=True)]
        self.state = []  # as distcache lays it out: [rows, state columns]
        for w in weights:
            rows, dim = w.shape
            cols = {"sgd": 0, "rowwise_adagrad": 1, "adagrad": dim, "adam": 2 * dim}
            self.state.append(torch.zeros(rows, cols[config.optimizer]))
        self.steps = 0

    def step(self, values, offsets, id_weights):
        params = [r.to(torch.float32, copy=True).requires_grad_() for r in self.rows]
        batch_size = (offsets.numel() - 1) // len(self.fmap)
        parts, used = [], [[] for _ in self.tables]
        for k, t in enumerate(self.fmap):
            lo, hi = int(offsets[k * batch_size]), int(offsets[(k + 1) * batch_size])
            bag_offsets = offsets[k * batch_size : (k + 1) * batch_size + 1] - lo
            out = torch.nn.functional.embedding_bag(
                values[lo:hi], params[t], bag_offsets[:-1], mode="sum",
                per_sample_weights=id_weights[lo:hi],
            )  # fmt: skip
            if self.tables[t].pooling == "mean":
                out = out / bag_offsets.diff().clamp(min=1).unsqueeze(1)
            parts.append(out)
            used[t].append(values[lo:hi])
        out = torch.cat(parts, dim=1)
        loss_of(out).backward()
        self.steps += 1
        for t, param in enumerate(params):
            rows = torch.cat(used[t]).unique()
            w, s = self._update(param.detach()[rows], self.state[t][rows], param.grad[rows])
            self.rows[t][rows] = w.to(self.rows[t].dtype)
            self.state[t][rows] = s
        return out.detach()

    def _update(self, w, s, g):
        """The row optimizers of `distcache.cache.optimizers`, restated: new rows and state."""
        c = self.config
        if c.optimizer == "sgd":
            return w - c.learning_rate * g, s
        if c.optimizer == "adagrad":
            s = s + g * g
            return w - c.learning_rate * g / (s.sqrt() + c.eps), s
        if c.optimizer == "rowwise_adagrad":
            s = s + (g * g).mean(dim=1, keepdim=True)
            return w - c.learning_rate * g / (s.sqrt() + c.eps), s
        dim = g.shape[1]  # lazy Adam, bias-corrected with the global step count
        m = c.beta1 * s[:, :dim] + (1 - c.beta1) * g
        v = c.beta2 * s[:, dim:] + (1 - c.beta2) * g * g
        rate = c.learning_rate * (1 - c.beta2**self.steps) ** 0.5 / (1 - c.beta1**self.steps)
        return w - rate * m / (v.sqrt() + c.eps), torch.cat([m, v], dim=1)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_weighted_features_match_a_reference_with_every_optimizer_and_half_rows(
    optimizer, dtype, kernel
):
    """Real-valued per-id weights on every update path (stateless and stateful optimizers,
    fp32 and fp16 rows, both kernels), step by step against `_DenseReference`: each output and
    the weights' own gradient (trainable weights: TorchRec's position-weighted features), then
    the rows and optimizer state, through evictions and write-backs."""
    tables = [
        dataclasses.replace(t, dtype=dtype) for t in make_tables([4, 8], [50, 40], ["mean", "sum"])
    ]
    fmap = [0, 1, 0]  # two features share t0
    feature_tables = [tables[t] for t in fmap]
    batches = make_batches(feature_tables, batch_size=3, num_batches=20, max_len=3, seed=8)
    gen = torch.Generator().manual_seed(9)
    id_weights = [0.5 + 1.5 * torch.rand(v.numel(), generator=gen) for v, _ in batches]
    weights = [(w / 8).to(dtype).float() for w in integer_weights(tables, 10)]
    config = CacheConfig(
        capacity=18, lookahead=3, prefetch_depth=1, optimizer=optimizer, learning_rate=0.05,
        eps=1e-6, kernel=kernel,
    )  # fmt: skip
    cached = CachedEmbeddingBags(tables, config, feature_table_map=fmap)
    for t, w in zip(tables, weights, strict=True):
        cached.load_table_weight(t.name, w)
    ref = _DenseReference(tables, weights, fmap, config)
    tol = {"atol": 4e-3, "rtol": 4e-3} if dtype == torch.float16 else {"atol": 1e-5, "rtol": 1e-4}
    enqueued = 0
    for step, (batch, per_id) in enumerate(zip(batches, id_weights, strict=True)):
        while enqueued < len(batches) and enqueued <= step + config.lookahead:
            cached.enqueue(*batches[enqueued])
            enqueued += 1
        cached.prefetch()
        mine, theirs = (per_id.clone().requires_grad_() for _ in range(2))
        out = cached(*batch, mine)
        loss_of(out).backward()
        ref_out = ref.step(*batch, theirs)
        torch.testing.assert_close(out, ref_out, **tol, msg=lambda m, s=step: f"step {s}: {m}")
        torch.testing.assert_close(mine.grad, theirs.grad, **tol)
    for k, t in enumerate(tables):
        torch.testing.assert_close(cached.table_weight(t.name).float(), ref.rows[k].float(), **tol)
        torch.testing.assert_close(cached.table_state(t.name), ref.state[k], **tol)
    assert all(s.writebacks > 0 for s in cached.stats().values())


class _RoutingStreams:
    """A cache's `Streams` as on CUDA for what `CachedEmbeddingBags` asks of it around a batch's
    lookup: the current stream is the one the test names, and each tensor kept for a stream is
    recorded; the rest is the CPU's (no-ops)."""

    cuda = True

    def __init__(self, cpu):  # noqa: ANN001
        self.cpu, self.now, self.kept = cpu, "default", []

    def current(self) -> str:
        return self.now

    def keep_for(self, tensor: torch.Tensor, stream: object) -> None:
        self.kept.append((tensor, stream))

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.cpu, name)


def test_a_batch_routed_on_another_stream_is_kept_for_the_stream_that_looks_it_up():
    """TorchRec's prefetch pipeline routes the next batch on a stream of its own and looks it up
    on the default one: every routed tensor of the batch is kept for the lookup's stream (its
    memory, freed after the backward, must not go back to the routing stream's pool before the
    lookup and the backward have read it). Routed and looked up on one stream: nothing kept."""
    tables = make_tables([4, 8], [40, 30])  # two widths: two groups, one engine each
    cached = CachedEmbeddingBags(tables, CacheConfig(capacity=16, lookahead=2), device="cpu")
    streams = _RoutingStreams(cached.engines[0].streams)
    cached.engines[0].streams = streams
    (values, offsets), other = make_batches(tables, batch_size=3, num_batches=2, max_len=3, seed=4)
    streams.now = "prefetch"
    cached.enqueue(values, offsets)
    streams.now = "default"
    cached(values, offsets).sum().backward()
    kept = [t for t, stream in streams.kept if stream == "default"]
    assert len(kept) >= 2 * 3  # per group at least its ids, offsets and bag of each id
    streams.kept.clear()
    cached.enqueue(*other)  # routed on the stream that looks it up
    cached(*other).sum().backward()
    assert not [t for t, stream in streams.kept if stream == "default"]


def test_a_lookup_without_gradients_in_training_mode_is_the_windows():
    """`torch.no_grad()` alone (training mode) looks up the oldest enqueued batch, as a
    training step would (benchmarks drive the caches so); only eval mode reads beside it."""
    tables = make_tables([4], [30])
    cached = CachedEmbeddingBags(tables, CacheConfig(capacity=12, lookahead=2))
    b1, b2 = make_batches(tables, batch_size=3, num_batches=2, max_len=2, seed=4)
    cached.enqueue(*b1)
    cached.enqueue(*b2)
    with torch.no_grad():
        cached(*b1)
    assert cached.num_enqueued == 1
    with pytest.raises(InvalidBatchError, match=r"model\.eval\(\)"):
        with torch.no_grad():
            cached(*b1)  # not the oldest now (b2), and not an evaluation


@pytest.mark.parametrize("stochastic", [None, False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_rows_updated_below_half_a_gap_move_only_when_rounded_stochastically(
    dtype, stochastic
):
    """Half rows at 1.0, each step's update a sixteenth of the gap to the next value: rounded
    to nearest (the default on CPU, as FBGEMM's CPU kernels round) they never move; rounded
    stochastically (FBGEMM's default on CUDA) they follow the fp32 reference on average
    (`CacheConfig.stochastic_rounding`)."""
    config = CacheConfig(capacity=64, stochastic_rounding=stochastic)
    moved, error, gap = updated_below_half_a_gap(config, dtype, "cpu")
    if stochastic:
        assert abs(error.mean().item()) < gap / 4  # unbiased (2.5 gaps in all; ~3 sigma)
        assert (moved != 0).any()
    else:
        assert torch.equal(moved, torch.zeros_like(moved))


def test_stochastic_rounding_is_a_bool_or_none_which_means_as_fbgemm():
    with pytest.raises(DistcacheConfigError, match="stochastic_rounding.*True, False, or None"):
        CacheConfig(stochastic_rounding="yes")
