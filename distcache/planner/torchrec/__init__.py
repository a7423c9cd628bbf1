"""The planner's only TorchRec importers: plans to and from TorchRec's `ShardingPlan`, and
TorchRec's own planner and estimator run on a distcache workload."""
