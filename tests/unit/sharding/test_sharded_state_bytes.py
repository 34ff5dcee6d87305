"""The Cephalo memory model counts the optimizer state the sharded runtime really keeps.

fp32: the parameters are the main values, so a rank keeps only Adam's two moments for its shard
(8 bytes per owned parameter; until 2026-11-26 the model counted a 12-byte fp32 master copy that the
shared distributed optimizer no longer keeps). Mixed precision keeps fp32 main values too (12).
"""

from __future__ import annotations

import pytest
import torch  # noqa: F401  (before the C extension, as everywhere)

from megatron_het.cluster import ModelSpec
from megatron_het.perf.sharded import sharded_rank_memory, state_bytes_for

from support.one_rank import one_rank_world

MODEL = ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64)


def test_state_bytes_per_precision():
    assert state_bytes_for("fp32").state_bytes == 8
    assert state_bytes_for("mixed").state_bytes == 12
    assert state_bytes_for("fp8") == state_bytes_for("bf16") == state_bytes_for("mixed")  # the run's precision
    assert state_bytes_for("tf32") == state_bytes_for("fp32")
    with pytest.raises(ValueError, match=r"precision: must be one of .* \(got 'int8'\)"):
        state_bytes_for("int8")


def test_predicted_state_equals_what_the_fp32_runtime_holds():
    from megatron_het.data.synthetic import synthetic_batch
    from megatron_het.plan import RankShare, ShardedPlan
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.sharding.trainer import ShardedTrainer
    from megatron_het.train.config import TrainConfig

    enable_cpu_backend()
    train = TrainConfig(micro_batch_size=1, global_batch_size=2, train_iters=1, lr=1e-4, log_interval=1)
    plan = ShardedPlan(ranks=(RankShare(rank=0, island="a", device_type="CPU", micro_batch_size=1,
                                        num_micro_batches=2, shard_fraction=1.0),), global_batch_size=2)

    def batch_fn(iteration, indices):
        return synthetic_batch(seed=1, iteration=iteration, indices=indices, seq_length=MODEL.seq_length,
                               vocab_size=MODEL.vocab_size)

    with one_rank_world():
        trainer = ShardedTrainer(model=MODEL, plan=plan, train=train, batch_fn=batch_fn)
        try:
            trainer.run(1)
            strategy = trainer.strategy
            adam = strategy.optimizer.adam
            held = sum(t.numel() * t.element_size() for t in (adam.master, adam.exp_avg, adam.exp_avg_sq))
            predicted = sharded_rank_memory(MODEL, shard_fraction=1.0, micro_batch_size=1, recompute=False,
                                            precision="fp32", overhead_bytes=0,
                                            num_parameters=strategy.index.numel).optimizer_bytes
        finally:
            trainer.close()
    assert held == predicted == 8 * strategy.index.numel
