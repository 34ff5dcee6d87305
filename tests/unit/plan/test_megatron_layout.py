"""Megatron-LM's layout flags build a plan over the cluster's islands when no --hetero-plan is given
(#35 item 2): the plan a Megatron script describes, each stage on the island its ranks fall on."""

from __future__ import annotations

import os

import pytest

from megatron_het.cluster import ModelSpec, load_cluster
from megatron_het.plan import PlanError, load_any_plan
from megatron_het.plan.megatron_layout import LayoutFlags, plan_from_layout_flags, stage_layer_counts

from support.paths import REPO

DEMO = load_cluster(os.path.join(REPO, "examples/clusters/cpu-demo.yaml"))  # islands fast 2, slow 2
H100_MI300X = load_cluster(os.path.join(REPO, "examples/clusters/h100-mi300x.yaml"))
MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=512)


def _plan(tp=1, pp=1, model=MODEL, cluster=DEMO, mbs=2, gbs=16, **kw):
    return plan_from_layout_flags(model, cluster, LayoutFlags(tensor_model_parallel_size=tp,
                                                              pipeline_model_parallel_size=pp, **kw),
                                  micro_batch_size=mbs, global_batch_size=gbs)


def test_the_demo_layout_from_flags_is_the_shipped_demo_plan():
    """TP2 x PP2 with a 3-layer first stage over cpu-demo is examples/plans/cpu-demo-hetero.json."""
    built = _plan(tp=2, pp=2, decoder_first_pipeline_num_layers=3)
    shipped = load_any_plan(os.path.join(REPO, "examples/plans/cpu-demo-hetero.json"))
    assert [[(s.island, s.ranks, s.layers) for s in r.stages] for r in built.replicas] == \
        [[(s.island, s.ranks, s.layers) for s in r.stages] for r in shipped.replicas]
    built.validate(MODEL, DEMO)


def test_data_parallel_replicas_follow_megatrons_rank_order_across_islands():
    plan = _plan(tp=1, pp=2)  # DP 2: rank = pp_rank * 2 + dp_rank
    assert [[(s.island, s.ranks) for s in r.stages] for r in plan.replicas] == [
        [("fast", (0,)), ("slow", (2,))], [("fast", (1,)), ("slow", (3,))]]
    assert [r.num_micro_batches for r in plan.replicas] == [4, 4]
    plan.validate(MODEL, DEMO)


def test_mixed_vendors_get_their_own_device_type():
    model = ModelSpec(num_layers=8, hidden_size=128, num_attention_heads=8, seq_length=64, vocab_size=512)
    plan = _plan(tp=8, pp=H100_MI300X.num_gpus // 8, model=model, cluster=H100_MI300X, mbs=1, gbs=8)
    types = {s.island: s.device_type for r in plan.replicas for s in r.stages}
    assert types == {i.name: i.device.name for i in H100_MI300X.islands}
    plan.validate(model, H100_MI300X)


def test_a_tensor_group_across_islands_is_refused_naming_both():
    with pytest.raises(PlanError, match=r"--tensor-model-parallel-size.*span islands fast and slow.*fast 2, slow 2"):
        _plan(tp=4)


def test_sizes_that_do_not_factor_the_world_are_refused():
    with pytest.raises(PlanError, match=r"3 x 1 does not divide the cluster's 4 ranks"):
        _plan(tp=3)


def test_interleaved_and_recompute_flags_reach_the_plan():
    plan = _plan(tp=1, pp=2, virtual_pipeline_size=2, recompute=True, recompute_num_layers=1)
    assert (plan.schedule, plan.virtual_pipeline_size) == ("interleaved", 2)
    assert all(s.recompute and s.recompute_num_layers == 1 for r in plan.replicas for s in r.stages)


@pytest.mark.parametrize("layers,pp,first,last,counts", [
    (8, 4, None, None, [2, 2, 2, 2]), (8, 3, 2, 2, [2, 4, 2]), (7, 2, 3, None, [3, 4]), (11, 4, 2, None, [2, 3, 3, 3])])
def test_megatrons_first_last_split(layers, pp, first, last, counts):
    assert stage_layer_counts(layers, pp, first=first, last=last) == counts


def test_uneven_middle_is_refused():
    with pytest.raises(PlanError, match="do not split evenly over 4 pipeline stages with "
                                        "--decoder-first-pipeline-num-layers 3"):
        stage_layer_counts(9, 4, first=3, last=3)
