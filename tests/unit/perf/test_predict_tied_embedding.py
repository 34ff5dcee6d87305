"""A tied word embedding's gradient group (first stage + the last stage's copy) is priced (perf.predict).

With tied weights (the GPT recipe) and more than one stage, the runtime reduces the word embedding's
gradient in a group of its own: every replica's first stage and last stage (runtime/grad_sync.py),
whatever their islands, after the last of their backwards. The predictor priced the first stage's copy
among the first stages and the last stage's among the last stages, and nothing at all with one replica,
so a pipeline whose ends sit on islands joined by a slow link was priced without the crossing."""

from __future__ import annotations

import dataclasses

from megatron_het.cluster import CATALOG, ClusterSpec, IslandSpec, LinkSpec, ModelSpec
from megatron_het.perf.comm import dp_gradient_reduction
from megatron_het.perf.memory import state_bytes
from megatron_het.perf.predict import predict
from megatron_het.plan import Plan, ReplicaPlan, StagePlan

GPT = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=51200)
CLUSTER = ClusterSpec(islands=(IslandSpec(name="a", device=CATALOG["A100-80GB"], nodes=1, gpus_per_node=2),
                               IslandSpec(name="b", device=CATALOG["H100-SXM"], nodes=1, gpus_per_node=2)),
                      links=(LinkSpec(between=("a", "b"), bandwidth_gbps=10),))


def _plan(replicas: int, model: ModelSpec = GPT) -> Plan:
    def replica(k):
        return ReplicaPlan(stages=(StagePlan(island="a", device_type="A100-80GB", ranks=(k,), layers=(0, 4)),
                                   StagePlan(island="b", device_type="H100-SXM", ranks=(2 + k,), layers=(4, 8))),
                           num_micro_batches=4)
    return Plan(replicas=tuple(replica(k) for k in range(replicas)), micro_batch_size=1,
                global_batch_size=4 * replicas, precision="bf16")


def test_one_replica_pays_the_embeddings_crossing_between_its_ends():
    pred = predict(_plan(1), GPT, CLUSTER)
    grad_bytes = state_bytes("bf16")[1]
    crossing = dp_gradient_reduction(grad_bytes * GPT.vocab_size * GPT.hidden_size, CLUSTER,
                                     replica_islands=["a", "b"]).total_s
    assert crossing > 0.1  # 200 MiB of fp32 gradients over 10 Gbit/s
    assert abs(pred.gradient_reduction_s - crossing) <= 1e-9 * crossing  # before: 0 (one replica: nothing)
    untied = dataclasses.replace(GPT, untie_embeddings_and_output_weights=True)
    assert predict(_plan(1, untied), untied, CLUSTER).gradient_reduction_s == 0.0


def test_with_two_replicas_the_group_spans_both_ends_of_both():
    pred = predict(_plan(2), GPT, CLUSTER)
    grad_bytes = state_bytes("bf16")[1]
    group = dp_gradient_reduction(grad_bytes * GPT.vocab_size * GPT.hidden_size, CLUSTER,
                                  replica_islands=["a", "b", "a", "b"], ranks_per_node=2).total_s
    first, last = pred.replicas[0].stages
    assert first.gradient_reduction_s >= group and last.gradient_reduction_s >= group
    # the layers' own reduction stays inside each island (a 2-rank ring on NVLink): far below the crossing
    assert first.gradient_reduction_s - group < 0.1 * group
    # it starts after the last backward of its holders (stage 0's, which ends the pipeline): exposed
    assert abs(pred.gradient_reduction_s - (first.gradient_reduction_end_s - pred.pipeline_time_s)) < 1e-9
    assert pred.gradient_reduction_s >= group


def test_ends_of_different_tp_sizes_reduce_the_whole_embedding_over_every_tp_rank():
    """First stage TP=2, last TP=1: grad_sync's reshard path, where every TP rank of every holder
    all-reduces a full vocab x hidden buffer (3 ranks here), not each end its own rows."""
    plan = Plan(replicas=(ReplicaPlan(stages=(
        StagePlan(island="a", device_type="A100-80GB", ranks=(0, 1), layers=(0, 4)),
        StagePlan(island="b", device_type="H100-SXM", ranks=(2,), layers=(4, 8))), num_micro_batches=4),),
        micro_batch_size=1, global_batch_size=4, precision="bf16")
    pred = predict(plan, GPT, CLUSTER)
    full = state_bytes("bf16")[1] * GPT.vocab_size * GPT.hidden_size
    first, last = pred.replicas[0].stages
    assert abs(last.gradient_reduction_s - dp_gradient_reduction(full, CLUSTER, replica_islands=["a", "a", "b"]
                                                                 ).total_s) < 1e-12
    assert abs(first.gradient_reduction_s - dp_gradient_reduction(full, CLUSTER, replica_islands=["a", "a", "b"],
                                                                  ranks_per_node=2).total_s) < 1e-12


def test_the_embeddings_reduction_follows_the_stages_own_on_its_network():
    """The first stage reduces its layers' gradients and then the tied embedding's (the plain
    synchronizer runs its buckets one after the other; overlapped, they share the rank's link), so
    both are exposed one after the other, not the longer of the two (as priced before)."""
    slow = ClusterSpec(islands=(IslandSpec(name="a", device=CATALOG["A100-80GB"], nodes=2, gpus_per_node=1,
                                           inter_node_bandwidth_gbps=10),
                                IslandSpec(name="b", device=CATALOG["H100-SXM"], nodes=2, gpus_per_node=1,
                                           inter_node_bandwidth_gbps=10)),
                       links=(LinkSpec(between=("a", "b"), bandwidth_gbps=10),))
    pred = predict(_plan(2), GPT, slow)
    grad_bytes = state_bytes("bf16")[1]
    group = dp_gradient_reduction(grad_bytes * GPT.vocab_size * GPT.hidden_size, slow,
                                  replica_islands=["a", "b", "a", "b"]).total_s
    first, _ = pred.replicas[0].stages
    layers = first.gradient_reduction_s - group  # the first stages' own group: 2 ranks over 10 Gbit/s
    assert layers > 0.2 * group  # both are large here
    # the first stage ends the pipeline last: everything after it is exposed, the two in sequence
    assert abs(pred.gradient_reduction_s - (layers + group)) <= 1e-6 * group  # before: max(layers, group)
    # the last stage too: its own group and the embedding's, both after the last holder's backward
    last = pred.replicas[0].stages[1]
    own_last = last.gradient_reduction_s - group
    assert abs(last.gradient_reduction_end_s - (pred.pipeline_time_s + group + own_last)) <= 1e-6 * group
    # the planner's closed form ranks layouts by the overlapped forms' combination (the embedding after
    # what is left of the stage's own), which the search also predicts for every layout: never above the
    # plain form's prediction, and below it by at most the overlap of the two reductions
    estimate, planned, own = _estimate(2, slow)
    assert estimate <= planned * (1 + 1e-9), (estimate, planned)
    assert planned - estimate <= own * (1 + 1e-6) + 0.03 * planned, (estimate, planned, own)


def _estimate(replicas: int, cluster: ClusterSpec) -> tuple[float, float, float]:
    """The planner's closed-form 1F1B estimate of a 2-stage [a | b] layout on ``cluster``, the
    prediction of the plan it builds and that plan's first stage's own (layers') reduction."""
    from megatron_het.planner.estimate import Estimator
    from megatron_het.planner.space import Segment, Template, build_plan

    gbs = 4 * replicas
    est = Estimator(GPT, cluster, global_batch_size=gbs, profile=None, distributed_optimizer=False)
    t = Template(segments=(Segment(island=0, tp=1, pp=1), Segment(island=1, tp=1, pp=1)), count=replicas)
    e = est.evaluate((t,), 1, False)
    plan = build_plan(cluster, e.templates, e.layer_counts, e.micro_batches, micro_batch_size=1,
                      global_batch_size=gbs, recompute=False, distributed_optimizer=False,
                      stage_recompute=e.stage_recompute)
    pred = predict(plan, GPT, cluster)
    first = pred.replicas[0].stages[0]
    own = first.gradient_reduction_s - dp_gradient_reduction(
        state_bytes("bf16")[1] * GPT.vocab_size * GPT.hidden_size, cluster, replica_islands=["a", "b"] * replicas
    ).total_s
    return e.iteration_time_s, pred.iteration_time_s, own
