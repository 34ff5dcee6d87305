"""Memory of interleaved stages whose chunks hold different layer counts (StagePlan.chunk_layers)."""

import pytest

from megatron_het.cluster import ConfigError, ModelSpec
from megatron_het.perf.memory import rank_memory, stage_memory
from megatron_het.plan import Plan, ReplicaPlan, StagePlan

MODEL = ModelSpec(num_layers=6, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=512)


def _stage(ranks, layers, chunks):
    return StagePlan(island="cpu", device_type="CPU", ranks=ranks, layers=layers, chunk_layers=chunks)


def test_a_stage_of_three_layers_in_two_chunks_is_priced_with_its_larger_chunk():
    """pretrain_gpt.py's end-of-run memory report crashed on such a plan (3 does not split into 2)."""
    plan = Plan(replicas=(ReplicaPlan(stages=(_stage((0,), (0, 3), ((0, 1), (3, 5))),
                                              _stage((1,), (3, 6), ((1, 3), (5, 6)))), num_micro_batches=4),),
                micro_batch_size=2, global_batch_size=8, schedule="interleaved", virtual_pipeline_size=2,
                precision="fp32")
    uneven = rank_memory(MODEL, plan, 0, padded_vocab=512).activations_bytes
    args = dict(is_first=False, is_last=False, micro_batch_size=2, microbatches_in_flight=3, virtual_stages=2)
    two = stage_memory(MODEL, num_layers=4, **args).activations_bytes  # 2 + 2 layers: 2 per chunk
    assert stage_memory(MODEL, num_layers=3, chunk_sizes=(1, 2), **args).activations_bytes == two
    assert uneven > 0
    with pytest.raises(ConfigError, match="2 chunks of 4 layers"):
        stage_memory(MODEL, num_layers=3, chunk_sizes=(2, 2), **args)
