"""The performance model of MoE models (docs/moe.md): routed compute, held experts, the EP all-to-all."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_het.cluster import ModelSpec, cluster_from_dict
from megatron_het.perf.comm import Channel, bytes_per_s, moe_all_to_all_times, moe_dispatch_times
from megatron_het.perf.flops import layer_gemms, layer_parameters_per_rank, mlp_widths

MIXTRAL = ModelSpec(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8,
                    seq_length=4096, vocab_size=32000, swiglu=True, untie_embeddings_and_output_weights=True,
                    add_bias_linear=False, num_experts=8, moe_router_topk=2, moe_token_dispatcher_type="alltoall")
DENSE = dataclasses.replace(MIXTRAL, num_experts=None, moe_router_topk=2, moe_token_dispatcher_type="allgather",
                            moe_ffn_hidden_size=None)


def test_a_token_runs_topk_experts_and_the_layer_holds_every_one():
    assert mlp_widths(MIXTRAL) == (2 * 14336, 8 * 14336) and mlp_widths(DENSE) == (14336, 14336)
    moe, dense = ({g.name: g for g in layer_gemms(m, micro_batch_size=1)} for m in (MIXTRAL, DENSE))
    assert moe["fc1"].flops == 2 * dense["fc1"].flops and moe["router"].n == 8
    # Mixtral 8x7B's published size: 46.7B parameters (every expert), of which the layers hold all but ~0.26B
    layers = 32 * layer_parameters_per_rank(MIXTRAL)
    assert layers == pytest.approx(46.4e9, rel=0.01)
    # EP 8: one expert per rank; EP 4 x expert-TP 2: one expert's half per rank, the attention whole
    per_rank = {ep_etp: layer_parameters_per_rank(MIXTRAL, ep=ep_etp[0], etp=ep_etp[1]) for ep_etp in ((8, 1), (4, 2))}
    attention_and_router = layer_parameters_per_rank(DENSE) - 3 * 4096 * 14336 + 8 * 4096
    assert per_rank[(8, 1)] == attention_and_router + 3 * 4096 * 14336
    assert per_rank[(4, 2)] == per_rank[(8, 1)]


def test_the_all_to_all_sends_the_off_rank_share_of_topk_copies():
    link = Channel(bandwidth_gbps=400.0, latency_us=0.0, host_staged=False)
    kw = dict(micro_batch_size=1, element_bytes=2)
    assert moe_all_to_all_times(MIXTRAL, link, ep=1, **kw).forward_s == 0.0
    assert moe_all_to_all_times(DENSE, link, ep=8, **kw).forward_s == 0.0
    t8 = moe_all_to_all_times(MIXTRAL, link, ep=8, **kw)
    off_rank = 2 * 4096 * 2 * 4096 * 7 / 8  # bytes x tokens x topk x h x (ep-1)/ep
    assert t8.forward_s == pytest.approx(2 * off_rank / bytes_per_s(400.0))  # dispatch + combine
    assert t8.backward_s == pytest.approx(t8.forward_s)
    full = moe_all_to_all_times(MIXTRAL, link, ep=8, recompute="full", **kw)
    assert full.backward_s == pytest.approx(2 * t8.forward_s)  # recomputation repeats the forward's
    sp = moe_all_to_all_times(MIXTRAL, link, ep=8, tp=4, sequence_parallel=True, **kw)
    assert sp.forward_s == pytest.approx(t8.forward_s / 4)  # a TP rank routes its sequence share


def test_predictor_prices_experts_and_the_all_to_all_by_placement():
    """The same plan with experts on every replica and spread over them: less memory per rank, an
    all-to-all in every MoE layer, slower over the islands' link than inside a node."""
    from megatron_het.perf.predict import expert_channels, predict
    from megatron_het.plan import Plan, ReplicaPlan, StagePlan

    cluster = cluster_from_dict({"islands": [{"name": "a", "device": "H100-SXM", "nodes": 1, "gpus_per_node": 8},
                                             {"name": "b", "device": "H100-SXM", "nodes": 1, "gpus_per_node": 8}],
                                 "links": [{"between": ["a", "b"], "bandwidth_gbps": 100}]})

    def plan(islands, **fields):
        return Plan(replicas=tuple(ReplicaPlan(stages=(StagePlan(island=isl, device_type="H100-SXM", ranks=(i,),
                                                                  layers=(0, 32)),), num_micro_batches=4)
                                   for i, isl in enumerate(islands)),
                    micro_batch_size=1, global_batch_size=8, precision="bf16", **fields)

    model = dataclasses.replace(MIXTRAL, seq_length=1024)
    same, ep_same, ep_cross = plan(["a", "a"]), plan(["a", "a"], expert_parallel=2), plan(["a", "b"], expert_parallel=2)
    assert expert_channels(same, cluster) == {}
    assert expert_channels(ep_same, cluster)[0].bandwidth_gbps == cluster.island("a").intra_node_bandwidth_gbps
    assert expert_channels(ep_cross, cluster)[0].bandwidth_gbps == pytest.approx(100.0)  # the islands' link
    p_same, p_ep, p_cross = (predict(p, model, cluster) for p in (same, ep_same, ep_cross))
    assert p_ep.memory_gib_per_rank_max < p_same.memory_gib_per_rank_max
    assert p_same.pipeline_time_s < p_ep.pipeline_time_s < p_cross.pipeline_time_s


def test_tp_traffic_of_an_moe_layer_follows_the_dispatcher():
    """Under TP with sequence parallelism an MoE layer keeps the attention's all-gather/reduce-scatter;
    its dispatcher's traffic replaces the MLP's: alltoall gathers the topk routed copies over expert-TP
    (twice the dense buffer at top-2), allgather the tokens over the expert grid (the dense buffer); with
    expert-TP 1 alltoall moves them by the EP all-to-all only; expert-TP beyond TP (at TP 1) gathers over
    the domain's replicas, on their link."""
    from megatron_het.perf.comm import (
        ring_all_gather_time,
        ring_reduce_scatter_time,
        tp_channel,
        tp_layer_comm_times,
    )

    island = cluster_from_dict({"islands": [{"name": "a", "device": "H100-SXM", "nodes": 1,
                                             "gpus_per_node": 8}]}).island("a")
    kw = dict(micro_batch_size=1, sequence_parallel=True, element_bytes=2)
    ch = tp_channel(island, 2)
    slow = Channel(bandwidth_gbps=10.0, latency_us=5.0, host_staged=False)

    def pair(nbytes, link=ch):
        args = dict(n=2, bandwidth_gbps=link.bandwidth_gbps, latency_us=link.latency_us)
        return ring_all_gather_time(nbytes, **args) + ring_reduce_scatter_time(nbytes, **args)

    def dispatch(model, **grid):
        return moe_dispatch_times(model, tp_link=ch, grid_link=slow, **kw, **grid).forward_s

    buffer = 2 * 4096 * 4096  # bytes x s x h
    assert tp_layer_comm_times(DENSE, island, tp=2, **kw).forward_s == pytest.approx(2 * pair(buffer))
    assert tp_layer_comm_times(MIXTRAL, island, tp=2, **kw).forward_s == pytest.approx(pair(buffer))  # attention
    shared = dataclasses.replace(MIXTRAL, moe_shared_expert_intermediate_size=4096)  # an MLP under the same SP
    assert tp_layer_comm_times(shared, island, tp=2, **kw).forward_s == pytest.approx(2 * pair(buffer))
    assert dispatch(MIXTRAL, tp=2, ep=1, etp=2) == pytest.approx(pair(2 * buffer))  # alltoall: topk copies
    allgather = dataclasses.replace(MIXTRAL, moe_token_dispatcher_type="allgather")
    assert dispatch(allgather, tp=2, ep=1, etp=2) == pytest.approx(pair(buffer))  # the tokens, once
    a2a_only = moe_all_to_all_times(MIXTRAL, slow, micro_batch_size=1, ep=2, tp=2, sequence_parallel=True,
                                    element_bytes=2).forward_s
    assert dispatch(MIXTRAL, tp=2, ep=2, etp=1) == pytest.approx(a2a_only)
    assert dispatch(allgather, tp=2, ep=2, etp=1) == pytest.approx(pair(buffer))  # its grid is the TP group
    at_tp1 = moe_dispatch_times(MIXTRAL, tp=1, ep=1, etp=2, tp_link=ch, grid_link=slow, **kw).forward_s
    assert at_tp1 == pytest.approx(pair(2 * 2 * buffer, slow))  # expert-TP 2 over two replicas' ranks
    assert moe_dispatch_times(DENSE, tp=2, ep=2, etp=1, tp_link=ch, grid_link=slow, **kw).forward_s == 0.0


def test_the_breakdown_of_an_expert_parallel_plan_has_no_negative_part():
    """perf/breakdown.explain on an EP-inside-TP plan priced from layers measured over TP and over EP ranks
    (bench/moe.py's profile shape): every part >= 0, the dispatch part what stage_cost adds beyond the
    measured layers (nothing: measured on the same links), and the parts sum to the iteration."""
    from megatron_het.cluster import load_cluster
    from megatron_het.perf.breakdown import explain
    from megatron_het.perf.profile import Profile, ProfileEntry
    from megatron_het.plan import Plan, ReplicaPlan, StagePlan

    from support.paths import REPO

    model = ModelSpec(num_layers=4, hidden_size=256, num_attention_heads=8, ffn_hidden_size=512, seq_length=128,
                      vocab_size=1000, swiglu=True, add_bias_linear=False, num_experts=8, moe_router_topk=2,
                      moe_token_dispatcher_type="alltoall")
    base = ProfileEntry(hidden_size=256, num_attention_heads=8, num_query_groups=8, ffn_hidden_size=512, swiglu=True,
                        seq_length=128, micro_batch_size=2, tp=1, forward_s=0.010, backward_s=0.016,
                        peak_memory_bytes=10**7, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=512,
                        moe_token_dispatcher_type="alltoall")
    entries = (base, dataclasses.replace(base, tp=2, includes_tp_comm=True, forward_s=0.017, backward_s=0.018),
               dataclasses.replace(base, tp=2, ep=2, includes_tp_comm=True, forward_s=0.013, backward_s=0.014))
    profile = Profile(device="CPU", entries=entries, method="test", source="p.json")
    cluster = load_cluster(REPO / "examples/clusters/cpu-2.yaml")
    stage = StagePlan(island="cpu", device_type="CPU", ranks=(0, 1), layers=(0, 4))
    plan = Plan(replicas=(ReplicaPlan(stages=(stage,), num_micro_batches=8),), micro_batch_size=2,
                global_batch_size=16, precision="fp32", sequence_parallel=True, expert_parallel=2,
                expert_tensor_parallel=1)
    pred, parts = explain(plan, model, cluster, profile=profile)
    assert min(parts.values()) >= 0.0, parts
    assert parts.get("moe_dispatch", 0.0) == 0.0 and parts["measured"] > 0
    assert sum(parts.values()) == pytest.approx(pred.iteration_time_s, rel=1e-9)
