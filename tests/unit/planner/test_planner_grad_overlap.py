"""The planner prices each layout also with its gradient all-reduce overlapped (planner/grad_overlap.py)."""

from __future__ import annotations

import dataclasses

from megatron_het.cluster import CATALOG, ClusterSpec, IslandSpec, LinkSpec, ModelSpec
from megatron_het.plan import homogeneous_plan
from megatron_het.planner import plan_cluster
from megatron_het.planner.grad_overlap import overlap_variant

PLAN = homogeneous_plan(tp=1, pp=2, dp=2, num_layers=4, micro_batch_size=1, global_batch_size=8, island="a",
                        device_type="A100-80GB")


def test_the_variant_drops_the_distributed_optimizer_and_records_the_overlap():
    v = overlap_variant(dataclasses.replace(PLAN, use_distributed_optimizer=True))
    assert not isinstance(v, str)
    assert v.overlap_grad_reduce and not v.use_distributed_optimizer and v.predicted is None


def test_no_variant_where_there_is_nothing_the_runtime_would_overlap():
    one = homogeneous_plan(tp=1, pp=2, dp=1, num_layers=4, micro_batch_size=1, global_batch_size=8, island="a",
                           device_type="A100-80GB")
    assert "one replica" in overlap_variant(one)
    assert "already" in overlap_variant(dataclasses.replace(PLAN, overlap_grad_reduce=True))
    inter = dataclasses.replace(PLAN, schedule="interleaved", virtual_pipeline_size=2)
    assert "interleaved" in overlap_variant(inter)


GPT_1_3B = ModelSpec(num_layers=24, hidden_size=2048, num_attention_heads=32, seq_length=2048, vocab_size=50257,
                     name="gpt-1.3b")


def _h100_h200() -> ClusterSpec:
    """4 H100 + 4 H200 at 2400 Gbit/s (tests/unit/planner/test_planner_modes.py's even cluster)."""
    return ClusterSpec(islands=(IslandSpec(name="a", device=CATALOG["H100-SXM"], nodes=1, gpus_per_node=4),
                                IslandSpec(name="b", device=CATALOG["H200"], nodes=1, gpus_per_node=4)),
                       links=(LinkSpec(between=("a", "b"), bandwidth_gbps=2400),))


def test_the_search_chooses_the_overlap_when_it_is_faster_and_says_so():
    """8 one-stage replicas, global batch 16: the whole model's all-reduce after a 2-micro-batch
    backward is worth hiding, and the unsharded Adam state of 1.3B fits."""
    cluster = _h100_h200()
    result = plan_cluster(GPT_1_3B, cluster, global_batch_size=16)
    best = result.best
    assert best.overlap_grad_reduce and not best.use_distributed_optimizer
    best.validate(GPT_1_3B, cluster)
    assert "overlapped with each stage's last backward" in result.explanation
    off = plan_cluster(GPT_1_3B, cluster, global_batch_size=16, consider_grad_overlap=False)
    assert not off.best.overlap_grad_reduce
    assert off.best.predicted["iteration_time_s"] > best.predicted["iteration_time_s"]
