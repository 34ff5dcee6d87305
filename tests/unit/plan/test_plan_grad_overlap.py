"""Plan.overlap_grad_reduce: recorded in JSON, beside the distributed optimizer too (the runtime runs both)."""

from __future__ import annotations

import dataclasses

from megatron_het.cluster import ModelSpec
from megatron_het.plan import Plan, homogeneous_plan

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128, name="t")
PLAN = homogeneous_plan(tp=1, pp=2, dp=2, num_layers=4, micro_batch_size=1, global_batch_size=8, island="a",
                        device_type="CPU")


def test_round_trips_and_older_plans_read_as_off():
    on = dataclasses.replace(PLAN, overlap_grad_reduce=True)
    assert Plan.from_dict(on.to_dict()).overlap_grad_reduce
    assert on.to_dict()["overlap_grad_reduce"] is True
    assert "overlap_grad_reduce" not in PLAN.to_dict()  # older plan files stay byte for byte
    assert not Plan.from_dict(PLAN.to_dict()).overlap_grad_reduce


def test_recorded_beside_the_distributed_optimizer():
    both = dataclasses.replace(PLAN, overlap_grad_reduce=True, use_distributed_optimizer=True)
    both.validate(MODEL)
    back = Plan.from_dict(both.to_dict())
    assert back.overlap_grad_reduce and back.use_distributed_optimizer
