"""Values that the cache's settings (`cache/config.py`) and the planner's core both name, kept
below both layers so that the planner needs no import of the cache package for them."""

HOT_ALL = "all"  # a replica's gradient: all of its rows all-reduced every step
HOT_TOUCHED = "touched"  # only the rows each rank touched, all-gathered
HOT_REDUCE = (HOT_ALL, HOT_TOUCHED)
"""How the gradients of a table's hot-row replica are summed across ranks each step
(`CacheConfig.hot_reduce`, `TablePlan.hot_reduce`)."""
# The smallest L within 1.10 x of Belady's optimum on MovieLens-100K (20 %, 30 % of distinct
# rows) and zipf traces (5 %, 10 %), batches of 64-256 (benchmarks/results/lookahead_sweep_*).
DEFAULT_LOOKAHEAD = 64
"""The look-ahead window's default length in batches (`CacheConfig.lookahead`, the planner's
`SolverOptions.lookaheads`)."""
