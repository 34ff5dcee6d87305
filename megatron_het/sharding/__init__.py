"""Uneven sharded data parallelism (Cephalo): compute share by speed, training-state share by memory.

Pure parts (import without torch.distributed set up): ``plan`` (ShardedPlan), ``layout`` (who
owns which flat elements, who computes which samples). Runtime parts: ``collectives`` (uneven
all-gather / reduce-scatter), ``optimizer`` (AdamW on a flat shard), ``trainer`` (the sharded
strategy of the one trainer, ``train/trainer.py``), ``checkpoint`` (save/load across shard layouts and
plans), ``budget`` (emulated memory capacity). pretrain_gpt.py runs a ShardedPlan like any plan.
The planner lives in ``megatron_het.planner.sharded``, the perf model in ``megatron_het.perf.sharded``.
"""

from megatron_het.sharding.budget import MemoryBudgetError, check_budget
from megatron_het.sharding.layout import FlatIndex, Segment, ShardLayout, proportional_split, sample_ranges, shard_sizes
from megatron_het.sharding.plan import (
    SHARDED_PLAN_FORMAT,
    SHARDED_PLAN_VERSION,
    RankShare,
    ShardedPlan,
    describe_sharded_plan,
    load_any_plan,
    validate_sharded_plan,
)

__all__ = [
    "FlatIndex", "MemoryBudgetError", "RankShare", "SHARDED_PLAN_FORMAT", "SHARDED_PLAN_VERSION", "Segment",
    "ShardLayout", "ShardedPlan", "check_budget", "describe_sharded_plan", "load_any_plan", "proportional_split",
    "sample_ranges", "shard_sizes", "validate_sharded_plan",
]
