"""The counters' names are declared once (`distcache/cache/counters.py`): the scheduler counts
every one, the engine's stats copy every one, `sum_stats` adds them up, and no other module of
the package spells the names out again. The pipeline's total and the job's metrics are checked
where they are built (`tests/unit/pipeline/test_lookahead.py`, `tests/distributed/test_train.py`).
"""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest

import distcache
from distcache import CacheConfig
from distcache.cache.counters import COUNTERS, LOGGED, SUMMED, CacheStats, Counters, sum_stats
from tests.unit.cache.reference import integer_weights, make_batches, make_tables, train_both

PACKAGE = Path(distcache.__file__).resolve().parent


def test_cache_stats_extend_the_counters() -> None:
    names = [f.name for f in fields(CacheStats)]
    assert names[: len(COUNTERS)] == list(COUNTERS) == [f.name for f in fields(Counters)]
    assert set(LOGGED) <= set(COUNTERS) and set(COUNTERS) <= set(SUMMED)
    assert set(names) - set(SUMMED) == {"graph_captures", "graph_replays"}  # one cache's own


def test_the_engine_reports_every_counter_its_scheduler_counted() -> None:
    tables = make_tables([4, 4], [40, 30])
    config = CacheConfig(capacity=16, lookahead=2, prefetch_depth=1, learning_rate=1.0)
    batches = make_batches(tables, batch_size=2, num_batches=12, max_len=3, seed=2)
    cached, _, _ = train_both(tables, config, batches, weights=integer_weights(tables, 1))
    for engine in cached.engines:
        counted, stats = engine.scheduler.counters, engine.stats()
        assert isinstance(counted, Counters) and counted.batches == len(batches)
        for name in COUNTERS:
            assert getattr(stats, name) == getattr(counted, name), name
        assert stats.loads > 0 and stats.evictions > 0  # the case counts something


def _stats(k: int) -> CacheStats:
    values = {f.name: k * (i + 1) for i, f in enumerate(fields(CacheStats))}
    return CacheStats(**values)


def test_sum_stats_adds_every_summed_field_and_the_hit_rate_over_all() -> None:
    a, b = _stats(1), _stats(3)
    total = sum_stats([a, b])
    assert list(total) == [*SUMMED, "hit_rate"]
    assert all(total[n] == getattr(a, n) + getattr(b, n) for n in SUMMED)
    assert total["hit_rate"] == pytest.approx((a.hits + b.hits) / (a.unique + b.unique))
    assert sum_stats([])["hit_rate"] == 0.0


def _spelled_counters(tree: ast.Module) -> list[int]:
    """Lines of tuple, list or set literals naming three counters or more."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            named = {e.value for e in node.elts if isinstance(e, ast.Constant)} & set(COUNTERS)
            if len(named) >= 3:
                lines.append(node.lineno)
    return lines


def test_no_module_but_counters_py_lists_the_counters() -> None:
    found = {
        path.relative_to(PACKAGE).as_posix(): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "counters.py" and (lines := _spelled_counters(ast.parse(path.read_text())))
    }
    assert not found, f"counter names listed outside distcache/cache/counters.py: {found}"
