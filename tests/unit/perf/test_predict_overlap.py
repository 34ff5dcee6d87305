"""perf.predict: when gradient reductions start and megatron-style overlapped buckets."""

import dataclasses

import pytest

from megatron_het.cluster import CATALOG, ClusterSpec, IslandSpec, ModelSpec
from megatron_het.perf.predict import bucket_parameters, overlapped_reduction_tail_s, predict
from megatron_het.plan import homogeneous_plan

MODEL = ModelSpec(num_layers=8, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=32000, name="t")


def test_bucket_size_is_megatron_default():
    assert bucket_parameters(8) == 40_000_000
    assert bucket_parameters(64) == 64_000_000


def test_tail_is_the_last_bucket_when_the_network_keeps_up():
    chunks = [(1.0, 50), (2.0, 50), (3.0, 50)]
    # Bucket of 100 ready at 2 s, reduced by 3 s; the last 50 ready at 3 s, reduced by 3.5 s.
    assert overlapped_reduction_tail_s(chunks, backward_s=3.0, bucket_params=100,
                                       reduce_s=lambda n: 0.01 * n) == pytest.approx(0.5)


def test_tail_includes_the_backlog_when_the_network_is_slow():
    chunks = [(1.0, 50), (2.0, 50), (3.0, 50)]
    assert overlapped_reduction_tail_s(chunks, backward_s=3.0, bucket_params=100,
                                       reduce_s=lambda n: 0.05 * n) == pytest.approx(6.5)


def _cluster() -> ClusterSpec:
    isl = IslandSpec(name="a", device=CATALOG["A100-80GB"], nodes=2, gpus_per_node=8, inter_node_bandwidth_gbps=25.0)
    return ClusterSpec(islands=(isl,))


def test_reduction_starts_when_each_stage_ends_and_overlap_only_shortens_it():
    plan = homogeneous_plan(tp=1, pp=4, dp=4, num_layers=8, micro_batch_size=1, global_batch_size=32,
                            island="a", device_type="A100-80GB")
    # untied: a tied embedding's group holds the first stages, so the last stage's reduction (its
    # bucket first, test_predict_tied_embedding.py) waits for stage 0's backward like stage 0's own
    untied = dataclasses.replace(MODEL, untie_embeddings_and_output_weights=True)
    plain = predict(plan, untied, _cluster())
    overlapped = predict(plan, untied, _cluster(), overlap_grad_reduce=True)
    stages = plain.replicas[0].stages
    # A later stage ends its backward before stage 0, so its reduction ends earlier than
    # pipeline end + its duration.
    last = stages[-1]
    assert last.gradient_reduction_end_s < plain.pipeline_time_s + last.gradient_reduction_s
    worst_end = max(s.gradient_reduction_end_s for s in stages)
    assert plain.gradient_reduction_s == pytest.approx(max(0.0, worst_end - plain.pipeline_time_s))
    assert overlapped.pipeline_time_s == pytest.approx(plain.pipeline_time_s)
    assert overlapped.iteration_time_s <= plain.iteration_time_s
    first_plain, first_over = stages[0], overlapped.replicas[0].stages[0]
    assert first_over.gradient_reduction_end_s < first_plain.gradient_reduction_end_s
    assert "gradient_reduction_end_s" in plain.to_json_dict()["replica_groups"][0]["stages"][0]


def _two_islands(second: str) -> ClusterSpec:
    from megatron_het.cluster import LinkSpec

    a = IslandSpec(name="a", device=CATALOG["A100-80GB"], nodes=1, gpus_per_node=8, inter_node_bandwidth_gbps=25.0)
    b = IslandSpec(name="b", device=CATALOG[second], nodes=1, gpus_per_node=8, inter_node_bandwidth_gbps=25.0)
    return ClusterSpec(islands=(a, b), links=(LinkSpec(between=("a", "b"), bandwidth_gbps=25.0),))


def _replica_per_island(cluster: ClusterSpec):
    import dataclasses

    from megatron_het.plan import Plan, ReplicaPlan, StagePlan

    reps = []
    for i, isl in enumerate(cluster.islands):
        stages = tuple(StagePlan(island=isl.name, device_type=isl.device.name, ranks=(4 * i + s,),
                                 layers=(4 * s, 4 * s + 4)) for s in range(2))
        reps.append(ReplicaPlan(stages=stages, num_micro_batches=8))
    plan = Plan(replicas=tuple(reps), micro_batch_size=1, global_batch_size=16)
    return plan, dataclasses.replace(plan, overlap_grad_reduce=True)


def test_a_plan_recording_overlap_is_priced_as_the_runtime_runs_it():
    cluster = _two_islands("A100-80GB")  # one collective library: every stage's buckets overlap
    plain, recorded = _replica_per_island(cluster)
    runtime = predict(plain, MODEL, cluster, overlap_grad_reduce=True, bucket_all_stages=True)
    got = predict(recorded, MODEL, cluster)
    assert got.iteration_time_s == pytest.approx(runtime.iteration_time_s)
    assert got.iteration_time_s < predict(plain, MODEL, cluster).iteration_time_s


def test_bridged_cross_vendor_reductions_are_not_overlapped():
    cluster = _two_islands("MI250X")  # NCCL + RCCL peers: the bridge has no asynchronous form
    plain, recorded = _replica_per_island(cluster)
    got = predict(recorded, MODEL, cluster)
    assert got.iteration_time_s == pytest.approx(predict(plain, MODEL, cluster).iteration_time_s)
    assert got.iteration_time_s > predict(plain, MODEL, cluster, overlap_grad_reduce=True,
                                          bucket_all_stages=False).iteration_time_s


def test_a_plan_recording_overlap_with_the_distributed_optimizer_is_priced_as_that_runtime():
    """The runtime's overlapped buckets all-reduce with the distributed optimizer too (each owner then
    takes its pieces) and the updated weights are gathered in the next forward: the reduction is
    priced as the plain overlapped plan's, the optimizer step and state as the sharded one's (plus the
    buckets' packed gradient copies); through the cross-vendor bridge nothing overlaps and the gather
    is exposed as well."""
    cluster = _two_islands("A100-80GB")
    plain, recorded = _replica_per_island(cluster)
    both = dataclasses.replace(recorded, use_distributed_optimizer=True)
    got, overlapped = predict(both, MODEL, cluster), predict(recorded, MODEL, cluster)
    sharded = predict(dataclasses.replace(plain, use_distributed_optimizer=True), MODEL, cluster)
    for g, o in zip(got.replicas[0].stages, overlapped.replicas[0].stages):
        assert g.gradient_reduction_end_s == pytest.approx(o.gradient_reduction_end_s)
    assert got.optimizer_s == pytest.approx(sharded.optimizer_s) and got.optimizer_s < overlapped.optimizer_s
    for g, sh in zip(got.replicas[0].stages, sharded.replicas[0].stages):  # sharded state; the buckets'
        # packed copies (held from launch to reduce()) double the gradient bytes, as in the plain overlap
        assert g.memory.optimizer_bytes == sh.memory.optimizer_bytes
        assert g.memory.gradients_bytes == 2 * sh.memory.gradients_bytes
        assert g.memory.total_bytes == sh.memory.total_bytes + sh.memory.gradients_bytes
    bridged = _two_islands("MI250X")
    plain_b, recorded_b = _replica_per_island(bridged)
    got_b = predict(dataclasses.replace(recorded_b, use_distributed_optimizer=True), MODEL, bridged)
    sync_b = predict(dataclasses.replace(plain_b, use_distributed_optimizer=True), MODEL, bridged)
    # all-reduce (twice the reduce-scatter's bytes) plus the gather, after the backward: no faster
    assert got_b.gradient_reduction_s >= sync_b.gradient_reduction_s
