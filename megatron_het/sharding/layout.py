"""Uneven shard arithmetic of the sharded strategy: lives in ``megatron_het/optim/layout.py`` (shared
with the pipeline runtime's distributed optimizer); re-exported here for existing imports."""

from megatron_het.optim.layout import FlatIndex, Segment, ShardLayout, proportional_split, sample_ranges, shard_sizes

__all__ = ["ShardLayout", "Segment", "FlatIndex", "shard_sizes", "sample_ranges", "proportional_split"]
