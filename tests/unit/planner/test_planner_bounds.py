"""Absurd sizes are refused at once, and large sane ones cost no per-sample work (#21 item 5)."""

from __future__ import annotations

import heapq
import random
import time

import pytest

from megatron_het.cluster import load_cluster, load_model
from megatron_het.perf.bounds import MAX_GLOBAL_BATCH_SIZE
from megatron_het.plan import PlanError
from megatron_het.planner import plan_best
from megatron_het.planner.sharded import _min_max_split

from support.paths import EXAMPLES


def _greedy(total, seconds):
    """The reference: one sample at a time to the rank that would finish it first."""
    counts = [0] * len(seconds)
    heap = [(t, i) for i, t in enumerate(seconds)]
    heapq.heapify(heap)
    for _ in range(total):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, ((counts[i] + 1) * seconds[i], i))
    return counts


def test_min_max_split_equals_the_per_sample_greedy():
    rng = random.Random(0)
    for _ in range(2000):
        seconds = [rng.choice([0.5, 1.0, 1.5, rng.uniform(0.1, 3.0)]) for _ in range(rng.randint(1, 9))]
        total = rng.randint(1, 2000)
        assert _min_max_split(total, seconds) == _greedy(total, seconds), (total, seconds)


def test_min_max_split_of_a_huge_batch_is_instant():
    start = time.monotonic()
    counts = _min_max_split(10**12, [1.0, 2.0, 4.0])
    assert time.monotonic() - start < 0.5
    assert sum(counts) == 10**12 and counts == [571428571429, 285714285714, 142857142857]


def test_plan_refuses_an_absurd_global_batch_naming_value_bound_and_why():
    model, cluster = load_model(EXAMPLES / "models/tiny-cpu.yaml"), load_cluster(EXAMPLES / "clusters/cpu-demo.yaml")
    start = time.monotonic()
    with pytest.raises(PlanError, match=rf"global_batch_size: exceeds the bound {MAX_GLOBAL_BATCH_SIZE:,} .*typo"
                                        r".*\(got 1000000000000\)"):
        plan_best(model, cluster, global_batch_size=10**12)
    assert time.monotonic() - start < 1.0


def test_plan_at_the_bound_finishes_quickly():
    """The largest accepted batch is priced in seconds: no list per micro-batch anywhere."""
    model, cluster = load_model(EXAMPLES / "models/tiny-cpu.yaml"), load_cluster(EXAMPLES / "clusters/cpu-demo.yaml")
    start = time.monotonic()
    choice = plan_best(model, cluster, global_batch_size=MAX_GLOBAL_BATCH_SIZE, pipeline_options={"top_k": 1})
    assert time.monotonic() - start < 20.0
    assert choice.plan.global_batch_size == MAX_GLOBAL_BATCH_SIZE


def _cluster_of(nodes: int):
    from megatron_het.cluster import cluster_from_dict

    return cluster_from_dict({"islands": [{"name": "a", "device": "A100-80GB", "nodes": nodes, "gpus_per_node": 8},
                                          {"name": "b", "device": "H100-SXM", "nodes": nodes, "gpus_per_node": 8}],
                              "links": [{"between": ["a", "b"], "bandwidth_gbps": 100}]})


def test_sharded_planner_refuses_more_ranks_than_it_can_price_and_auto_falls_back():
    from megatron_het.planner.errors import InfeasibleError
    from megatron_het.planner.sharded import MAX_SHARDED_RANKS, plan_sharded

    model = load_model(EXAMPLES / "models/llama2-7b.yaml")
    huge = _cluster_of(65_536)  # 2^20 GPUs: the largest cluster file accepted
    start = time.monotonic()
    with pytest.raises(InfeasibleError, match=rf"1,048,576 GPUs exceed the sharded planner's bound of "
                                              rf"{MAX_SHARDED_RANKS:,} .*Fix: use the pipeline planner"):
        plan_sharded(model, huge, global_batch_size=512)
    assert time.monotonic() - start < 2.0
    choice = plan_best(model, huge, global_batch_size=512, pipeline_options={"top_k": 1})
    assert choice.mode == "pipeline" and time.monotonic() - start < 30.0
