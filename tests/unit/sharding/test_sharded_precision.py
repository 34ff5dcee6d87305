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


def _sharded_plan(**kw):
    from megatron_het.plan import RankShare, ShardedPlan

    ranks = tuple(RankShare(rank=i, island="a", device_type="A100-80GB", micro_batch_size=2, num_micro_batches=3,
                            shard_fraction=0.5) for i in range(2))
    return ShardedPlan(ranks=ranks, global_batch_size=12, **kw)


def test_a_sharded_plan_records_its_precision_and_is_priced_and_run_at_it():
    """The plan is the record (as a pipeline plan's precision): tools/predict.py, slurm.py's memory check and
    the host profile price it at it, pretrain_gpt.py trains in it. Before, a sharded plan chosen at fp32 was
    re-priced at bf16 by every later tool (2.155 s planned, 0.759 s predicted for one file in review)."""
    from megatron_het.plan import ShardedPlan
    from megatron_het.plan.errors import PlanError
    from megatron_het.planner.sharded import plan_sharded, predict_sharded

    fp32 = _sharded_plan(precision="fp32")
    again = ShardedPlan.from_json(fp32.to_json())
    assert again.precision == "fp32"
    assert predict_sharded(again, MODEL, CLUSTER).compute_s == _compute_s("fp32")
    old = ShardedPlan.from_json(_sharded_plan().to_json())  # a file from before the field
    assert old.precision is None and '"precision"' not in _sharded_plan().to_json()
    assert predict_sharded(old, MODEL, CLUSTER).compute_s == _compute_s("mixed")
    with pytest.raises(PlanError, match="unknown precision"):
        _sharded_plan(precision="int8")
    planned = plan_sharded(MODEL, CLUSTER, global_batch_size=12, precision="fp32")
    assert planned.precision == "fp32"
    assert plan_sharded(MODEL, CLUSTER, global_batch_size=12).precision == "bf16"  # "mixed" recorded as bf16


def test_pretrain_trains_a_sharded_plan_in_its_precision():
    from megatron_het.cluster import ConfigError
    from megatron_het.runtime.plan_record import reconcile_precision
    from megatron_het.train.config import TrainConfig

    train = TrainConfig(micro_batch_size=2, global_batch_size=12, train_iters=1)
    assert train.precision == "fp32"
    assert reconcile_precision(None, train) == train  # old file: the flags decide, as before
    assert reconcile_precision("bf16", train).precision == "bf16"  # no flag: the plan's
    with pytest.raises(ConfigError, match="the plan was priced at bf16, the flag asks for fp16"):
        reconcile_precision("bf16", TrainConfig(micro_batch_size=2, global_batch_size=12, train_iters=1, fp16=True))
