"""The planner's expert parallelism (#37): EP searched as a dimension, its domains respected, the choice explained."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_het.cluster import load_cluster, load_model
from megatron_het.perf.predict import predict
from megatron_het.plan.validate import validate_plan
from megatron_het.planner.errors import InfeasibleError
from megatron_het.planner.estimate import Estimator
from megatron_het.planner.search import expert_parallel_options, plan_cluster
from megatron_het.planner.space import Segment, Template
from megatron_het.planner.summary import expert_placement

from support.paths import REPO

MIXTRAL = load_model(REPO / "examples/models/mixtral-8x7b.yaml")
LLAMA = load_model(REPO / "examples/models/llama2-7b.yaml")
H100_MI300X = load_cluster(REPO / "examples/clusters/h100-mi300x.yaml")


def test_the_ep_sizes_searched():
    assert expert_parallel_options(MIXTRAL, H100_MI300X) == [1, 2, 4, 8]
    assert expert_parallel_options(LLAMA, H100_MI300X) == [1]
    many = dataclasses.replace(MIXTRAL, num_experts=256, moe_router_topk=8)
    assert expert_parallel_options(many, H100_MI300X) == [1, 2, 4, 8, 16, 32, 64]  # capped at 64


def test_mixtral_on_two_vendors_is_planned_with_expert_parallelism():
    """Mixtral 8x7B on 32 H100 + 32 MI300X: every EP is searched and the fastest predicted kept (EP 8
    here: each rank holds one expert per layer, which lets TP 1 stages fit); the plan validates, its
    domains are EP consecutive identical replicas with equal micro-batches, and the explanation and
    the placement line say what was chosen."""
    result = plan_cluster(MIXTRAL, H100_MI300X, global_batch_size=512)
    best = result.best
    assert best.expert_parallel == 8 and best.sequence_parallel
    validate_plan(best, MIXTRAL, H100_MI300X)
    assert "Expert parallelism 8 chosen among the EP sizes searched" in result.explanation
    assert "EP 1 " in result.explanation  # every EP's best plan is reported
    for first in range(0, len(best.replicas), 8):
        domain = best.replicas[first:first + 8]
        assert len({(tuple((s.island, s.tp, s.layers) for s in r.stages), r.num_micro_batches) for r in domain}) == 1
    line = expert_placement(best, MIXTRAL.num_experts)
    assert line.startswith("experts: EP 8") and "each rank holds 1 of the 8 experts" in line
    # the choice is the predictor's: EP 1 (experts replicated) at its best is slower
    ep1 = plan_cluster(MIXTRAL, H100_MI300X, global_batch_size=512, expert_parallel=1)
    assert ep1.best.expert_parallel == 1
    assert predict(best, MIXTRAL, H100_MI300X).iteration_time_s < ep1.candidates[0][1].iteration_time_s


def test_an_ep_that_cannot_be_planned_is_refused_with_the_fix():
    with pytest.raises(InfeasibleError, match=r"must divide num_experts 8. Fix: use one of \[1, 2, 4, 8\]"):
        plan_cluster(MIXTRAL, H100_MI300X, global_batch_size=512, expert_parallel=3)
    with pytest.raises(InfeasibleError, match="needs an MoE model"):
        plan_cluster(LLAMA, H100_MI300X, global_batch_size=512, expert_parallel=2)


def test_expert_domains_constrain_the_estimate():
    """A template whose replica count is not a multiple of EP, or micro-batches that do not split over
    domains, is infeasible with the reason; a valid point's micro-batches are equal within each domain."""
    est = Estimator(MIXTRAL, H100_MI300X, global_batch_size=64, profile=None, distributed_optimizer=True,
                    expert_parallel=4)
    h100 = [i for i, isl in enumerate(H100_MI300X.islands) if isl.device.name == "H100-SXM"][0]
    mi300x = 1 - h100
    spanning = (Segment(island=h100, tp=1, pp=1), Segment(island=mi300x, tp=1, pp=1))
    odd = est.evaluate((Template(segments=spanning, count=6),), 1, False)
    assert isinstance(odd, str) and "a template has 6 replicas" in odd
    point = est.evaluate((Template(segments=spanning, count=8),), 1, False)
    assert not isinstance(point, str), point
    (m, high), = point.micro_batches
    assert high % 4 == 0  # the replicas given m (the rest m - 1) fill whole domains
    uneven = Estimator(MIXTRAL, H100_MI300X, global_batch_size=66, profile=None, distributed_optimizer=True,
                       expert_parallel=4).evaluate((Template(segments=spanning, count=8),), 1, False)
    assert isinstance(uneven, str) and "66 micro-batches do not split over domains of 4" in uneven


def test_the_estimate_holds_the_experts_optimizer_state_whole_as_predict_does():
    """Under EP the predictor counts the experts' optimizer state whole on each holder (an upper bound:
    the distributed optimizer shards it over fewer ranks than the replicas); the search's closed-form
    memory line must say the same, or it ranks plans that do not fit (a 14-layer Mixtral stage at EP 8
    over 32 replicas: 47 GiB in the estimate against 74 GiB predicted before)."""
    from megatron_het.perf.memory import stage_memory

    est = Estimator(MIXTRAL, H100_MI300X, global_batch_size=512, profile=None, distributed_optimizer=True,
                    expert_parallel=8)
    line = est.memory_line(0, 1, 1, False, first=True, last=False, in_flight=2, dp=32)
    for n in (1, 14):
        predicted = stage_memory(MIXTRAL, num_layers=n, is_first=True, is_last=False, micro_batch_size=1,
                                 microbatches_in_flight=2, tp=1, dp=32, distributed_optimizer=True, ep=8,
                                 precision="bf16")
        assert line[0] + (n - 1) * line[1] == pytest.approx(predicted.total_bytes, rel=1e-6)


def test_progress_ends_at_its_total_and_every_failing_ep_is_summed_up():
    """One progress count over every EP searched, done == total at the last call; when no EP fits, one
    line per EP with its reason, EP 1's report, and what EP itself needs."""
    calls = []
    plan_cluster(MIXTRAL, H100_MI300X, global_batch_size=512, progress=lambda d, t: calls.append((d, t)))
    assert calls[-1][0] == calls[-1][1] and all(d <= t for d, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)  # never counts back between the EP searches
    tiny = load_cluster(REPO / "examples/clusters/h100-8.yaml")
    with pytest.raises(InfeasibleError) as err:
        plan_cluster(MIXTRAL, tiny, global_batch_size=8, micro_batch_sizes=(1,), recompute_options=(False,))
    text = str(err.value)
    assert text.startswith("no plan fits mixtral-8x7b at any expert parallelism searched:")
    assert all(f"  EP {ep}: " in text for ep in (1, 2, 4, 8)) and "EP 1 (experts replicated): " in text
    assert "replicas in groups of EP" in text
