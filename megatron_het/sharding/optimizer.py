"""The sharded AdamW: one implementation in ``megatron_het/optim/adamw.py`` for the sharded strategy
and the pipeline runtime's distributed optimizer; re-exported here for existing imports."""

from megatron_het.optim.adamw import ShardedAdamW, decay_runs, decays

__all__ = ["ShardedAdamW", "decay_runs", "decays"]
