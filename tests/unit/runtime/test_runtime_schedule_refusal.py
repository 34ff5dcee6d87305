"""The runtime refuses, before building anything, a plan whose schedule it does not implement (#16)."""

from dataclasses import replace

import pytest

from megatron_het.cluster import ModelSpec
from megatron_het.plan import PlanError, homogeneous_plan
from megatron_het.runtime.hetero_trainer import PipelineStrategy
from megatron_het.train.config import TrainConfig

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=200)


@pytest.mark.parametrize(("schedule", "vp", "pp", "message"), [
    ("zb-h1", 2, 2, "virtual_pipeline_size: schedule 'zb-h1' runs 1 model chunk per stage, not 2"),
    ("interleaved", 2, 1, "the runtime runs interleaved (virtual_pipeline_size=2) only with >= 2 stages per replica"),
    ("interleaved", 1, 2, "the interleaved schedule needs at least 2 model chunks per stage"),
])
def test_unimplemented_schedule_is_refused_naming_it(schedule, vp, pp, message):
    plan = replace(homogeneous_plan(tp=1, pp=pp, dp=1, num_layers=4, micro_batch_size=1, global_batch_size=4),
                   schedule=schedule, virtual_pipeline_size=vp)
    train = TrainConfig(micro_batch_size=1, global_batch_size=4, train_iters=1)
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PipelineStrategy(model=MODEL, plan=plan, train=train, batch_fn=None)
