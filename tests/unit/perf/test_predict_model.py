"""perf.predict: hand-checkable times, uneven micro-batches, memory, schedule options."""

from dataclasses import replace

import pytest

from megatron_het.cluster import CATALOG, ClusterSpec, IslandEmulation, IslandSpec, LinkSpec, ModelSpec
from megatron_het.perf import (
    OPTIMIZER_STEP_BYTES,
    Profile,
    ProfileEntry,
    embedding_times,
    logits_times,
    model_flops_per_iteration,
    predict,
    stage_parameters,
)
from megatron_het.plan import Plan, ReplicaPlan, StagePlan, homogeneous_plan

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=512, name="tiny")
CPU = CATALOG["CPU"]


def _profile(fwd: float = 0.01, bwd: float = 0.02) -> Profile:
    entry = ProfileEntry(hidden_size=64, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=256,
                         swiglu=False, seq_length=64, micro_batch_size=1, tp=1, forward_s=fwd, backward_s=bwd,
                         peak_memory_bytes=1000)
    return Profile(device="CPU", entries=(entry,), method="test")


def _cluster(slowdowns=(1.0, 1.0)) -> ClusterSpec:
    islands = tuple(IslandSpec(name=f"i{k}", device=CPU, nodes=1, gpus_per_node=4) for k in range(len(slowdowns)))
    links = (LinkSpec(between=("i0", "i1"), bandwidth_gbps=10.0, latency_us=50.0),) if len(islands) == 2 else ()
    emulation = {f"i{k}": IslandEmulation(slowdown=s) for k, s in enumerate(slowdowns)}
    return ClusterSpec(islands=islands, links=links, emulation=emulation)


def _single_stage(m: int) -> Plan:
    return homogeneous_plan(tp=1, pp=1, dp=1, num_layers=4, micro_batch_size=1, global_batch_size=m,
                            island="i0", device_type="CPU")


def test_one_stage_time_is_exact():
    cluster = _cluster()
    pred = predict(_single_stage(8), MODEL, cluster, profile=_profile())
    emb = embedding_times(MODEL, CPU, micro_batch_size=1)
    out = logits_times(MODEL, CPU, micro_batch_size=1)
    per_mb = 4 * (0.01 + 0.02) + emb.forward_s + emb.backward_s + out.forward_s + out.backward_s
    params = stage_parameters(MODEL, num_layers=4, is_first=True, is_last=True)
    optimizer = OPTIMIZER_STEP_BYTES * params / (CPU.memory_bandwidth_gbs * 1e9)
    assert pred.pipeline_time_s == pytest.approx(8 * per_mb, rel=1e-12)
    assert pred.gradient_reduction_s == 0.0
    assert pred.optimizer_s == pytest.approx(optimizer, rel=1e-12)
    assert pred.iteration_time_s == pytest.approx(8 * per_mb + optimizer, rel=1e-12)
    assert pred.tokens_per_s == pytest.approx(8 * 64 / pred.iteration_time_s)
    flops = model_flops_per_iteration(MODEL, global_batch_size=8)
    assert pred.tflops_per_gpu == pytest.approx(flops / pred.iteration_time_s / 1e12)
    d = pred.to_json_dict()
    for key in ("iteration_time_s", "tokens_per_s", "tflops_per_gpu", "memory_gib_per_rank_max", "fits"):
        assert key in d
    stage = d["replica_groups"][0]["stages"][0]
    assert stage["forward_s"] == pytest.approx(4 * 0.01 + emb.forward_s + out.forward_s)
    assert set(stage["memory_parts_gib"]) == {"parameters", "gradients", "optimizer", "activations", "overhead"}


def test_emulation_slowdown_multiplies_compute():
    fast = predict(_single_stage(4), MODEL, _cluster((1.0, 1.0)), profile=_profile())
    slow = predict(_single_stage(4), MODEL, _cluster((2.0, 1.0)), profile=_profile())
    assert slow.pipeline_time_s == pytest.approx(2 * fast.pipeline_time_s)


def test_uneven_micro_batches_slowest_replica_sets_the_time():
    stage = lambda isl, r: StagePlan(island=isl, device_type="CPU", ranks=(r,), layers=(0, 4))  # noqa: E731
    plan = Plan(replicas=(ReplicaPlan(stages=(stage("i0", 0),), num_micro_batches=6),
                          ReplicaPlan(stages=(stage("i1", 1),), num_micro_batches=2)),
                micro_batch_size=1, global_batch_size=8)
    pred = predict(plan, MODEL, _cluster(), profile=_profile())
    a, b = pred.replicas
    assert (a.num_micro_batches, b.num_micro_batches) == (6, 2)
    assert a.pipeline_time_s == pytest.approx(3 * b.pipeline_time_s)
    assert pred.pipeline_time_s == pytest.approx(a.pipeline_time_s)
    assert pred.gradient_reduction_s > 0  # two replicas on two islands reduce across the link
    # Balanced by a 3x slower island the same split is even.
    slowed = predict(plan, MODEL, _cluster((1.0, 3.0)), profile=_profile())
    assert slowed.replicas[0].pipeline_time_s == pytest.approx(slowed.replicas[1].pipeline_time_s)


def test_two_stage_1f1b_includes_bubble_and_p2p():
    plan = homogeneous_plan(tp=1, pp=2, dp=1, num_layers=4, micro_batch_size=1, global_batch_size=4,
                            island="i0", device_type="CPU")
    pred = predict(plan, MODEL, _cluster(), profile=_profile())
    stage_busy = [s.compute_s for s in pred.replicas[0].stages]
    assert pred.pipeline_time_s > max(stage_busy)  # the bubble
    assert all(s.idle_s > 0 for s in pred.replicas[0].stages)


def test_recompute_adds_a_forward_and_shrinks_activations():
    plan = _single_stage(4)
    rc = replace(plan, replicas=tuple(replace(r, stages=tuple(replace(s, recompute=True) for s in r.stages))
                                      for r in plan.replicas))
    base, more = predict(plan, MODEL, _cluster(), profile=_profile()), predict(rc, MODEL, _cluster(), profile=_profile())
    s0, s1 = base.replicas[0].stages[0], more.replicas[0].stages[0]
    assert s1.backward_s == pytest.approx(s0.backward_s + 4 * 0.01)
    assert s1.memory.activations_bytes < s0.memory.activations_bytes


def test_interleaved_reduces_the_bubble():
    big = replace(MODEL, num_layers=8)
    plan = homogeneous_plan(tp=1, pp=2, dp=1, num_layers=8, micro_batch_size=1, global_batch_size=4,
                            island="i0", device_type="CPU")
    inter = replace(plan, schedule="interleaved", virtual_pipeline_size=2)
    p1, p2 = predict(plan, big, _cluster()), predict(inter, big, _cluster())
    assert p2.pipeline_time_s < p1.pipeline_time_s


def test_memory_overflow_is_reported():
    huge = ModelSpec(num_layers=4, hidden_size=8192, num_attention_heads=64, seq_length=2048, vocab_size=32000)
    pred = predict(_single_stage(1), huge, _cluster())
    assert not pred.fits
    assert pred.memory_gib_per_rank_max > 16.0
    assert pred.to_json_dict()["replica_groups"][0]["stages"][0]["fits"] is False
