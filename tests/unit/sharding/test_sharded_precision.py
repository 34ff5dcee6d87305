"""The sharded mode is priced at the run's precision (perf.sharded, #17's precision line).

Its compute used to be priced at bf16 whatever the run: an fp32 run (pretrain_gpt.py without a
precision flag) on A100s got bf16 tensor-core rates in the sharded mode while the pipeline mode beside
it was priced in fp32, so ``--hetero-plan auto`` compared the two modes at different precisions.
Checked against ``perf.predict.stage_cost`` at each precision (the pipeline mode's prices) and the
runtime's bytes per parameter."""

from __future__ import annotations

import pytest

from megatron_het.cluster import CATALOG, ClusterSpec, IslandSpec, ModelSpec
from megatron_het.perf.predict import stage_cost
from megatron_het.perf.sharded import predict_sharded_ranks, state_bytes_for

MODEL = ModelSpec(num_layers=4, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=32000)
CLUSTER = ClusterSpec(islands=(IslandSpec(name="a", device=CATALOG["A100-80GB"], nodes=1, gpus_per_node=2),))


def _compute_s(precision: str) -> float:
    return predict_sharded_ranks(MODEL, CLUSTER, islands=["a", "a"], micro_batch_sizes=[2, 2],
                                 num_micro_batches=[3, 3], shard_fractions=[0.5, 0.5], recompute=[False, False],
                                 global_batch_size=12, precision=precision).compute_s


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
def test_compute_follows_the_runs_precision(precision):
    cost = stage_cost(MODEL, CLUSTER.island("a"), tp=1, micro_batch_size=2, precision=precision)
    L = MODEL.num_layers
    expected = 3 * (cost.forward_s(L, is_first=True, is_last=True) + cost.backward_s(L, is_first=True, is_last=True))
    assert abs(_compute_s(precision) - expected) <= 1e-12 * expected


def test_fp32_is_priced_slower_than_mixed_on_tensor_cores():
    assert _compute_s("mixed") == _compute_s("bf16")  # "mixed" keeps its meaning: bf16 compute
    assert _compute_s("fp32") > 4 * _compute_s("mixed")  # A100: 19.5 vs 312 dense TFLOP/s (before: equal)
    assert _compute_s("tf32") < _compute_s("fp32")


def test_bytes_follow_the_storage_each_precision_implies():
    assert state_bytes_for("tf32") == state_bytes_for("fp32")
    assert state_bytes_for("bf16") == state_bytes_for("fp16") == state_bytes_for("mixed")
    with pytest.raises(ValueError, match="precision: must be one of"):
        state_bytes_for("int8")
