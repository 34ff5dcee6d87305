"""Tangram-style planning: a second parallelizer plugged in, the LP composition, replicas of
different shapes, idle hardware explained, grouped listings."""

from dataclasses import replace

import numpy as np
import pytest

from megatron_het.cluster import CATALOG, ClusterSpec, IslandSpec, LinkSpec, load_model
from megatron_het.plan import validate_plan
from megatron_het.planner import plan_cluster
from megatron_het.planner.compose import Shape, compose, fill_idle, shapes, solve_lp
from megatron_het.planner.estimate import Estimator
from megatron_het.planner.parallelizer import IntraConfig, LayerSlice, MegatronParallelizer
from megatron_het.planner.space import Segment, Template
from megatron_het.planner.summary import candidates_table, rank_ranges, summarize_plan

TINY = load_model("examples/models/tiny-cpu.yaml")
LLAMA7 = load_model("examples/models/llama2-7b.yaml")


def _three_types(h100: int = 16, a100: int = 16, mi250: int = 8, cross_gbps: float = 50.0) -> ClusterSpec:
    islands = (IslandSpec(name="h100", device=CATALOG["H100-SXM"], nodes=h100 // 8, gpus_per_node=8,
                          inter_node_bandwidth_gbps=400.0),
               IslandSpec(name="a100", device=CATALOG["A100-80GB"], nodes=a100 // 8, gpus_per_node=8,
                          inter_node_bandwidth_gbps=200.0),
               IslandSpec(name="mi250", device=CATALOG["MI250X"], nodes=mi250 // 8, gpus_per_node=8,
                          inter_node_bandwidth_gbps=200.0))
    links = (LinkSpec(between=("h100", "a100"), bandwidth_gbps=100.0),
             LinkSpec(between=("h100", "mi250"), bandwidth_gbps=cross_gbps),
             LinkSpec(between=("a100", "mi250"), bandwidth_gbps=cross_gbps))
    return ClusterSpec(islands=islands, links=links)


class ToyParallelizer:
    """A second parallelizer: TP=2 only, no recompute, every layer twice as slow as Megatron's."""

    name = "toy"

    def __init__(self, model, cluster):
        self.inner = MegatronParallelizer(model, cluster, max_tp=2)
        self.calls = 0

    def candidates(self, slice_: LayerSlice, island_index: int, budget_bytes: int) -> list[IntraConfig]:
        self.calls += 1
        out = []
        for c in self.inner.candidates(replace(slice_, recompute_allowed=False), island_index, budget_bytes):
            if c.tp != 2:
                continue
            cost = replace(c.cost, layer_forward_s=2 * c.cost.layer_forward_s,
                           layer_backward_s=2 * c.cost.layer_backward_s)
            out.append(replace(c, cost=cost))
        return out


def test_plans_with_a_toy_parallelizer_plugged_in():
    cluster = ClusterSpec(
        islands=(IslandSpec(name="fast", device=CATALOG["CPU"], nodes=1, gpus_per_node=4),
                 IslandSpec(name="slow", device=CATALOG["CPU"], nodes=1, gpus_per_node=2)),
        links=(LinkSpec(between=("fast", "slow"), bandwidth_gbps=10.0),))
    default = plan_cluster(TINY, cluster, global_batch_size=16, max_tp=1)
    assert all(s.tp == 1 for r in default.best.replicas for s in r.stages)
    toy = ToyParallelizer(TINY, cluster)
    result = plan_cluster(TINY, cluster, global_batch_size=16, parallelizer=toy)
    assert toy.calls > 0
    # Only what the toy offers: TP=2 everywhere, no recompute.
    assert all(s.tp == 2 and not s.recompute for r in result.best.replicas for s in r.stages)
    validate_plan(result.best, TINY, cluster)
    # The search priced the toy's slower layers: its closed form differs from Megatron's for one layout.
    one = (Template(segments=(Segment(island=0, tp=2, pp=2),), count=1),)
    mine = Estimator(TINY, cluster, global_batch_size=16, profile=None, distributed_optimizer=True,
                     parallelizer=ToyParallelizer(TINY, cluster)).evaluate(one, 1, False)
    theirs = Estimator(TINY, cluster, global_batch_size=16, profile=None, distributed_optimizer=True
                       ).evaluate(one, 1, False)
    assert mine.iteration_time_s > 1.5 * theirs.iteration_time_s


def test_megatron_parallelizer_respects_the_budget_and_offers_recompute():
    cluster = _three_types()
    par = MegatronParallelizer(LLAMA7, cluster)
    slice_ = LayerSlice(num_layers=8, is_first=True, is_last=False, micro_batch_size=1, in_flight=4,
                        data_parallel=4, recompute_allowed=True)
    every = par.candidates(slice_, 0, 2**62)
    assert {c.tp for c in every} == {1, 2, 4, 8} and {c.recompute for c in every} == {False, True}
    for c in every:  # recompute saves memory; a larger budget never loses candidates
        assert c.memory_per_layer_bytes > 0
    tight = sorted(c.memory_bytes for c in every)[len(every) // 2]
    kept = par.candidates(slice_, 0, tight)
    assert 0 < len(kept) < len(every) and all(c.memory_bytes <= tight for c in kept)


def test_solve_lp_matches_a_known_optimum():
    # max 3x + 2y s.t. x + y <= 4, x + 3y <= 6, x <= 3  ->  x = 3, y = 1, value 11
    x = solve_lp(np.array([3.0, 2.0]), np.array([[1.0, 1.0], [1.0, 3.0], [1.0, 0.0]]), np.array([4.0, 6.0, 3.0]))
    assert x == pytest.approx([3.0, 1.0])
    assert float(np.array([3.0, 2.0]) @ x) == pytest.approx(11.0)


def test_shapes_span_islands_and_compositions_fit_the_cluster():
    cluster = _three_types()
    est = Estimator(LLAMA7, cluster, global_batch_size=256, profile=None, distributed_optimizer=True)
    found = shapes(est, [0, 1, 2], tps={0: [2], 1: [4], 2: [8]}, mbs=1, recompute=False, replicas=4)
    assert all(isinstance(s, Shape) and s.period_s > 0 and s.fill_s >= s.period_s for s in found)
    assert any(sum(g > 0 for g in s.gpus) == 3 for s in found)  # some shapes span all three types
    structures = compose(est, [0, 1, 2], tps={0: [2], 1: [4], 2: [8]}, mbs=1, recompute=False, bases=[])
    assert structures
    for structure in structures:
        used = [0, 0, 0]
        for t in structure:
            for s in t.segments:
                used[s.island] += t.count * s.tp * s.pp
        assert all(u <= i.num_gpus for u, i in zip(used, cluster.islands))
        assert not isinstance(est.evaluate(structure, 1, False), str)


def test_fill_idle_adds_replicas_of_another_shape_when_that_is_faster():
    cluster = _three_types(mi250=8, cross_gbps=400.0)
    est = Estimator(LLAMA7, cluster, global_batch_size=256, profile=None, distributed_optimizer=True)
    base = (Template(segments=(Segment(island=0, tp=2, pp=2),), count=4),)  # half of the H100s, nothing else
    found = shapes(est, [0, 1, 2], tps={0: [2], 1: [4], 2: [8]}, mbs=1, recompute=False, replicas=4)
    filled = fill_idle(est, base, found, mbs=1, recompute=False)
    assert filled
    best = filled[-1]
    assert len(best) > 1 or best[0].count > base[0].count
    assert est.evaluate(best, 1, False).iteration_time_s < est.evaluate(base, 1, False).iteration_time_s


def test_idle_islands_are_explained_with_the_alternative_and_the_reason():
    """Global batch 64: the MI250X island stays idle (at 128 the plan uses every island). The
    alternative is priced as the chosen plan is, in its fastest schedule and reduction form
    (here ZB-H1 with the all-reduce overlapped), and the line says which."""
    cluster = _three_types(h100=16, a100=8, mi250=8, cross_gbps=25.0)
    result = plan_cluster(LLAMA7, cluster, global_batch_size=64)
    used = {}
    for r in result.best.replicas:
        for s in r.stages:
            used[s.island] = used.get(s.island, 0) + s.tp
    idle = [i for i in cluster.islands if used.get(i.name, 0) < i.num_gpus]
    assert len(result.idle) == len(idle)
    for island, line in zip(idle, result.idle):
        assert line.startswith(f"idle: {island.num_gpus - used.get(island.name, 0)} of {island.num_gpus}")
        assert island.name in line
        assert ("tokens/s" in line and "lost on" in line) or "no priced plan uses them" in line
    assert result.idle and "(zb-h1, " in result.idle[0], result.idle
    for line in result.idle:
        assert line in result.explanation


def test_rank_ranges_and_grouped_listing_fit_a_screen():
    assert rank_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert rank_ranges([]) == ""
    cluster = _three_types(h100=64, a100=64, mi250=16)
    result = plan_cluster(LLAMA7, cluster, global_batch_size=512)
    lines = summarize_plan(result.best)
    assert len(lines) <= 10 and len(result.best.replicas) > 8
    full = summarize_plan(result.best, verbose=True)
    assert len(full) >= len(result.best.replicas)
    table = candidates_table(result.candidates)
    assert len(table) == len(result.candidates) + 1 and all(len(row) <= 160 for row in table)
    for row, (plan, _) in zip(table[1:], result.candidates):  # rows of one layout differ in these two
        fields = row.split()
        assert plan.schedule in fields
        grads = {(True, False): "dist-opt", (True, True): "dopt+ovl", (False, True): "overlap",
                 (False, False): "sync"}[plan.use_distributed_optimizer, plan.overlap_grad_reduce]
        assert grads in fields
