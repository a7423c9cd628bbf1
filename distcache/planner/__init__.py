"""The throughput planner (in progress): access statistics first."""

from distcache.planner.stats import AccessProfile, expected_loads, expected_unique

__all__ = ["AccessProfile", "expected_loads", "expected_unique"]
