"""Measured parts of a profile: embedding/output parts, optimizer step, host links (alpha-beta fit),
and how predict() uses them."""

import json

import pytest

from megatron_het.cluster import ConfigError, ModelSpec, cluster_from_dict
from megatron_het.perf import predict
from megatron_het.perf.calibrate import with_measured_links
from megatron_het.perf.comm import p2p_time, ring_all_reduce_time, tp_layer_comm_times
from megatron_het.perf.compute import embedding_times, layer_times, logits_times
from megatron_het.perf.predict import optimizer_step_s
from megatron_het.perf.profile import (
    MeasuredLink,
    load_profile,
    lookup_part,
    profile_from_dict,
    profile_to_dict,
    save_profile,
)
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.profiling.links import fit_link

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000)
LAYER = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=32, tp=1)


def _doc(**extra):
    return {"format": "megatron-het-profile", "version": 1, "device": "CPU", "method": "test",
            "entries": [{**LAYER, "micro_batch_size": 2, "forward_s": 0.010, "backward_s": 0.020,
                         "peak_memory_bytes": 1000}], **extra}


PARTS = [{"part": "embedding", "hidden_size": 64, "vocab_size": 1024, "seq_length": 32, "micro_batch_size": 1,
          "tp": 1, "forward_s": 0.001, "backward_s": 0.002},
         {"part": "embedding", "hidden_size": 64, "vocab_size": 1024, "seq_length": 32, "micro_batch_size": 4,
          "tp": 1, "forward_s": 0.004, "backward_s": 0.005},
         {"part": "output", "hidden_size": 64, "vocab_size": 1024, "seq_length": 32, "micro_batch_size": 2,
          "tp": 1, "forward_s": 0.003, "backward_s": 0.006}]
LINK = {"ranks": 2, "latency_us": 100.0, "bandwidth_gbps": 8.0, "method": "test",
        "samples": [{"op": "all_reduce", "bytes": 4096, "seconds": 0.0002}]}
FULL = _doc(parts=PARTS, optimizer={"seconds_per_parameter": 1e-8, "method": "m"}, communication=LINK)


def test_optional_sections_round_trip(tmp_path):
    profile = profile_from_dict(FULL)
    path = tmp_path / "p.json"
    save_profile(profile, path)
    loaded = load_profile(path)
    assert loaded.parts == profile.parts and len(loaded.parts) == 3
    assert loaded.optimizer_s_per_parameter == 1e-8 and loaded.optimizer_method == "m"
    assert loaded.link == MeasuredLink(ranks=2, latency_us=100.0, bandwidth_gbps=8.0, method="test",
                                       samples=(("all_reduce", 4096, 0.0002),))
    # a file without them still loads and writes none of them
    plain = profile_to_dict(profile_from_dict(_doc()))
    assert not {"parts", "optimizer", "communication"} & set(plain)


@pytest.mark.parametrize("bad, where", [
    ({"parts": [{**PARTS[0], "part": "lm_head"}]}, "parts[0].part"),
    ({"parts": [PARTS[0], PARTS[0]]}, "parts[1]"),
    ({"communication": {**LINK, "samples": [{"op": "alltoall", "bytes": 1, "seconds": 1.0}]}},
     "communication.samples[0].op"),
    ({"communication": {**LINK, "bandwidth_gbps": 0}}, "communication.bandwidth_gbps"),
    ({"optimizer": {"seconds": 1.0}}, "optimizer"),
])
def test_bad_sections_name_the_field(bad, where):
    with pytest.raises(ConfigError) as err:
        profile_from_dict(_doc(**bad))
    assert where in str(err.value)


def test_part_lookup_interpolates_in_tokens():
    profile = profile_from_dict(FULL)
    shape = dict(hidden_size=64, vocab_size=1024, seq_length=32)
    mid = lookup_part(profile, "embedding", micro_batch_size=2, **shape)
    assert (mid.forward_s, mid.backward_s) == pytest.approx((0.002, 0.003))  # 1/3 of the way from 1 to 4
    assert lookup_part(profile, "embedding", micro_batch_size=8, **shape).forward_s == pytest.approx(0.008)
    assert lookup_part(profile, "output", micro_batch_size=1, **shape).forward_s == pytest.approx(0.0015)
    assert lookup_part(profile, "output", micro_batch_size=2, tp=2, **shape) is None
    # compute.py uses them (the model's vocabulary 1000 is padded to 1024 like Megatron)
    dev = cluster_from_dict({"islands": [{"name": "a", "device": "CPU", "nodes": 1, "gpus_per_node": 2}]}).islands[0]
    out = logits_times(MODEL, dev.device, micro_batch_size=2, profile=profile)
    assert (out.forward_s, out.backward_s) == (0.003, 0.006)
    # tp=2 was not measured: the tp=1 measurement scaled by the analytic model's tp ratio
    a1 = logits_times(MODEL, dev.device, micro_batch_size=2, tp=2)
    a0 = logits_times(MODEL, dev.device, micro_batch_size=2)
    out2 = logits_times(MODEL, dev.device, micro_batch_size=2, tp=2, profile=profile)
    assert out2.forward_s == pytest.approx(0.003 * a1.forward_s / a0.forward_s)
    emb = embedding_times(MODEL, dev.device, micro_batch_size=2, profile=profile)
    assert emb.forward_s == pytest.approx(0.002)


def test_layer_times_scale_a_tp1_measurement_to_tp2():
    profile = profile_from_dict(FULL)
    dev = cluster_from_dict({"islands": [{"name": "a", "device": "CPU", "nodes": 1, "gpus_per_node": 2}]}).islands[0]
    lt = layer_times(MODEL, dev.device, micro_batch_size=2, tp=2, profile=profile)
    a2 = layer_times(MODEL, dev.device, micro_batch_size=2, tp=2)
    a1 = layer_times(MODEL, dev.device, micro_batch_size=2, tp=1)
    assert lt.forward_s == pytest.approx(0.010 * a2.forward_s / a1.forward_s)
    assert lt.backward_s == pytest.approx(0.020 * a2.backward_s / a1.backward_s)
    assert 0.004 < lt.forward_s < 0.010 and "scaled to tp=2" in lt.source


def test_fit_link_recovers_alpha_and_beta():
    alpha, bw = 150e-6, 2e9  # seconds, bytes/s
    samples = []
    for n in (4096, 65536, 1 << 20, 8 << 20):
        samples.append(("all_reduce", n, 2 * alpha + n / bw))  # 2 ranks: 2(n-1)=2 steps, 2(n-1)/n = 1
        samples.append(("send_recv", n, alpha + n / bw))
    link = fit_link(samples, ranks=2)
    assert link.latency_us == pytest.approx(150.0, rel=1e-6)
    assert link.bandwidth_gbps == pytest.approx(16.0, rel=1e-6)
    with pytest.raises(ValueError, match="2 message sizes"):
        fit_link(samples[:2], ranks=2)
    with pytest.raises(ValueError, match="ranks must be >= 2 to measure communication, got 1"):
        fit_link(samples, ranks=1)


CLUSTER = {"islands": [{"name": "fast", "device": "CPU", "nodes": 1, "gpus_per_node": 2},
                       {"name": "slow", "device": "CPU", "nodes": 1, "gpus_per_node": 2}],
           "links": [{"between": ["fast", "slow"], "bandwidth_gbps": 10, "latency_us": 50}],
           "emulation": {"slow": {"slowdown": 2.0}}}


def test_measured_links_replace_the_cluster_files_figures():
    profile = profile_from_dict(FULL)
    cluster = cluster_from_dict(CLUSTER)
    cal = with_measured_links(cluster, profile)
    isl = cal.island("fast")
    assert (isl.intra_node_bandwidth_gbps, isl.intra_node_latency_us) == (8.0, 100.0)
    # emulated, one device type: every rank is a process of this host, so the island link is too
    assert p2p_time(1e6, cal, src="fast", dst="slow") == pytest.approx(100e-6 + 1e6 / 1e9)
    assert p2p_time(1e6, cluster, src="fast", dst="slow") == pytest.approx(50e-6 + 1e6 / 1.25e9)
    tp = tp_layer_comm_times(MODEL, isl, micro_batch_size=2, tp=2)
    one = ring_all_reduce_time(2 * 32 * 2 * 64, n=2, bandwidth_gbps=8.0, latency_us=100.0)
    assert tp.forward_s == pytest.approx(2 * one)
    # not emulated: links between islands stay as written
    real = cluster_from_dict({k: v for k, v in CLUSTER.items() if k != "emulation"})
    assert with_measured_links(real, profile).link("fast", "slow").bandwidth_gbps == 10.0
    assert with_measured_links(cluster, None) is cluster


def test_predict_uses_measured_optimizer_and_links():
    profile = profile_from_dict(FULL)
    cluster = cluster_from_dict(CLUSTER)
    dev = cluster.island("fast").device
    assert optimizer_step_s(dev, 1000, profile=profile) == pytest.approx(1e-5)
    assert optimizer_step_s(dev, 1000) == pytest.approx(30 * 1000 / 50e9)
    s = lambda isl, r, lay: StagePlan(island=isl, device_type="CPU", ranks=(r,), layers=lay)
    plan = Plan(replicas=(ReplicaPlan(stages=(s("fast", 0, (0, 4)),), num_micro_batches=2),
                          ReplicaPlan(stages=(s("slow", 2, (0, 4)),), num_micro_batches=2)),
                micro_batch_size=2, global_batch_size=8)
    pred = predict(plan, MODEL, cluster, profile=profile)
    stages = [r.stages[0] for r in pred.replicas]
    from megatron_het.perf.flops import stage_parameters
    params = stage_parameters(MODEL, num_layers=4, is_first=True, is_last=True, tp=1)
    assert stages[0].optimizer_s == pytest.approx(1e-8 * params)
    assert stages[1].optimizer_s == pytest.approx(2 * 1e-8 * params)  # the emulated slowdown
    # gradient reduction over the measured link between the two islands
    red = stages[0].gradient_reduction_s
    assert red > 0 and red == pytest.approx(stages[1].gradient_reduction_s)
    assert json.dumps(pred.to_json_dict())  # still serialisable
