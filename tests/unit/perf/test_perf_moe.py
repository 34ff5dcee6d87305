"""The performance model of MoE models (docs/moe.md): routed compute, held experts, the EP all-to-all."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_het.cluster import ModelSpec, cluster_from_dict
from megatron_het.perf.comm import Channel, bytes_per_s, moe_all_to_all_times
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
    its MLP's pair becomes the dispatcher's gather of the topk routed copies over the expert-TP ranks
    (twice the dense buffer at top-2), and nothing with expert-TP 1 (the EP all-to-all moves them)."""
    from megatron_het.perf.comm import ring_all_gather_time, ring_reduce_scatter_time, tp_channel, tp_layer_comm_times

    island = cluster_from_dict({"islands": [{"name": "a", "device": "H100-SXM", "nodes": 1,
                                             "gpus_per_node": 8}]}).island("a")
    kw = dict(micro_batch_size=1, tp=2, sequence_parallel=True, element_bytes=2)
    dense = tp_layer_comm_times(DENSE, island, **kw)
    ch = tp_channel(island, 2)

    def pair(nbytes):
        args = dict(n=2, bandwidth_gbps=ch.bandwidth_gbps, latency_us=ch.latency_us)
        return ring_all_gather_time(nbytes, **args) + ring_reduce_scatter_time(nbytes, **args)

    buffer = 2 * 4096 * 4096  # bytes x s x h
    assert dense.forward_s == pytest.approx(2 * pair(buffer))
    assert tp_layer_comm_times(MIXTRAL, island, **kw).forward_s == pytest.approx(pair(buffer) + pair(2 * buffer))
    etp1 = tp_layer_comm_times(MIXTRAL, island, etp=1, **kw)
    assert etp1.forward_s == pytest.approx(pair(buffer)) and etp1.backward_s == pytest.approx(pair(buffer))
