"""The AxoNN parallelizer offers 3D tensor-parallel grids priced by the 4D model (perf/axonn.py)
and the plan uses one only where the model says it exposes less TP communication than 1D TP.

Documented configurations (docs/planner.md, "3D tensor parallelism"):

* 3D wins: GPT 13B shape (h=5120, 40 heads, seq 2048) on one node of 8 x A100-80GB (NVLink),
  global batch 32: the planner picks TP=2 stages, run as grid [2, 1, 1] (chunked, overlapped
  collectives hide more than the extra activation volume costs); at 64, since every schedule is
  priced on every layout predicted (#19), 2-stage TP=1 replicas under ZB-H1 are predicted faster;
* 1D wins: the same model with its TP pair split over two nodes linked at 25 Gbit/s (one GPU per
  node): the 3D grids move more bytes than overlap can hide; and the tiny CPU test model on A100s,
  whose GEMMs are too small to hide anything.
"""

import pytest

from megatron_het.cluster import CATALOG, IslandSpec, ModelSpec, cluster_from_dict
from megatron_het.plan import homogeneous_plan
from megatron_het.planner import describe_plan, plan_cluster
from megatron_het.planner.parallelizer import AxonnParallelizer, LayerSlice, tp_grid_choice

GPT13B = ModelSpec(num_layers=40, hidden_size=5120, num_attention_heads=40, seq_length=2048, vocab_size=50304,
                   name="gpt-13b")
TINY = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=512, name="tiny")
NODE = {"islands": [{"name": "a100", "device": "A100-80GB", "nodes": 1, "gpus_per_node": 8}]}
ETH = {"islands": [{"name": "eth", "device": "A100-80GB", "nodes": 2, "gpus_per_node": 1,
                    "inter_node_bandwidth_gbps": 25}]}


def test_planner_runs_a_3d_grid_where_the_4d_model_says_it_wins():
    cluster = cluster_from_dict(NODE)
    result = plan_cluster(GPT13B, cluster, global_batch_size=32, micro_batch_sizes=(1, 2),
                          parallelizer=AxonnParallelizer(GPT13B, cluster))
    stages = [s for r in result.best.replicas for s in r.stages]
    assert {s.tp for s in stages} == {2} and {s.tp_grid for s in stages} == {(2, 1, 1)}
    assert "a100 TP=2 grid [2, 1, 1]" in describe_plan(result.best)
    assert "a100 TP=2: 3D grid [2, 1, 1] (AxoNN)" in result.explanation
    assert result.best.replicas[0].stages[0].to_dict()["tp_grid"] == [2, 1, 1]
    # the default (Megatron) parallelizer never writes a grid: 3D is opt-in until the runtime builds it
    default = plan_cluster(GPT13B, cluster, global_batch_size=32, micro_batch_sizes=(1, 2))
    assert all(s.tp_grid is None for r in default.best.replicas for s in r.stages)


def test_the_3d_configuration_comes_first_and_is_priced_lower():
    cluster = cluster_from_dict(NODE)
    par = AxonnParallelizer(GPT13B, cluster)
    slice_ = LayerSlice(num_layers=1, is_first=False, is_last=False, micro_batch_size=1, in_flight=1,
                        data_parallel=1, recompute_allowed=False)
    tp2 = [c for c in par.candidates(slice_, 0, 2**62) if c.tp == 2]
    assert [c.tp_grid for c in tp2] == [(2, 1, 1), None]
    choice = par.grid_choice(0, 2, 1)
    assert choice.exposed_3d_s < choice.exposed_1d_s
    saved = choice.exposed_1d_s - choice.exposed_3d_s
    one, three = tp2[1].cost, tp2[0].cost
    total = lambda c: c.layer_forward_s + c.layer_backward_s  # noqa: E731
    assert total(one) - total(three) == pytest.approx(saved, rel=1e-9)


@pytest.mark.parametrize("model, island, tp", [
    (GPT13B, IslandSpec(name="eth", device=CATALOG["A100-80GB"], nodes=2, gpus_per_node=1,
                        inter_node_bandwidth_gbps=25.0), 2),
    (TINY, IslandSpec(name="a100", device=CATALOG["A100-80GB"], nodes=1, gpus_per_node=8), 2),
    (TINY, IslandSpec(name="a100", device=CATALOG["A100-80GB"], nodes=1, gpus_per_node=8), 4),
])
def test_1d_tp_is_kept_where_the_4d_model_says_3d_loses(model, island, tp):
    choice = tp_grid_choice(model, island, tp, micro_batch_size=1)
    assert choice.grid is None and choice.best_3d is not None
    assert choice.exposed_1d_s < choice.exposed_3d_s
    assert "1D TP, cheaper than the best 3D grid" in choice.describe(island.name)


def test_assign_keeps_1d_and_says_why_over_a_slow_link():
    cluster = cluster_from_dict(ETH)
    par = AxonnParallelizer(GPT13B, cluster)
    plan = homogeneous_plan(tp=2, pp=1, dp=1, num_layers=40, micro_batch_size=1, global_batch_size=8,
                            island="eth", device_type="A100-80GB")
    out, lines = par.assign_tp_grids(plan)
    assert out == plan  # no grid written
    assert len(lines) == 1 and lines[0].startswith("eth TP=2: 1D TP, cheaper than the best 3D grid [2, 1, 1]")
    slice_ = LayerSlice(num_layers=1, is_first=False, is_last=False, micro_batch_size=1, in_flight=1,
                        data_parallel=1, recompute_allowed=False)
    assert all(c.tp_grid is None for c in par.candidates(slice_, 0, 2**62))


def test_gated_models_are_never_offered_a_grid():
    island = IslandSpec(name="a100", device=CATALOG["A100-80GB"], nodes=1, gpus_per_node=8)
    gated = ModelSpec(num_layers=40, hidden_size=5120, num_attention_heads=40, seq_length=2048, vocab_size=50304,
                      swiglu=True)
    choice = tp_grid_choice(gated, island, 2, micro_batch_size=1)
    assert choice.grid is None and choice.best_3d is None and "gated MLP" in choice.describe("a100")
