"""Training pipelines that keep the look-ahead window full."""

from distcache.pipeline.lookahead import LookaheadTrainPipeline

__all__ = ["LookaheadTrainPipeline"]
