"""`benchmarks/_common.ratio_interval`: the paired bootstrap interval of a throughput ratio."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _common import ratio_interval  # noqa: E402


def test_the_interval_holds_the_ratio_and_narrows_with_more_steps():
    rng = np.random.default_rng(1)
    drift = rng.uniform(0.5, 2.0, 400)  # the machine's speed, shared by both variants' steps
    base = (0.010 * drift * rng.lognormal(0, 0.1, 400)).tolist()
    other = (0.0125 * drift * rng.lognormal(0, 0.1, 400)).tolist()  # 0.8 x the base's rate
    low, high = ratio_interval(base, other)
    assert low < sum(base) / sum(other) < high and low < 0.8 < high
    few = ratio_interval(base[:40], other[:40])
    assert few[1] - few[0] > high - low
    assert ratio_interval(base, other) == (low, high)  # seeded: the same report twice
    # Paired: the shared drift cancels, where unpaired steps would leave it in the interval.
    assert high - low < 0.05
