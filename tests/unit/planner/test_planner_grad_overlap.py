"""The planner prices each layout also with its gradient all-reduce overlapped (planner/grad_overlap.py)."""

from __future__ import annotations

import dataclasses

from megatron_het.cluster import CATALOG, ClusterSpec, IslandSpec, LinkSpec, ModelSpec
from megatron_het.perf.predict import predict
from megatron_het.plan import homogeneous_plan
from megatron_het.planner import plan_cluster
from megatron_het.planner.grad_overlap import overlap_note, overlap_variants

PLAN = homogeneous_plan(tp=1, pp=2, dp=2, num_layers=4, micro_batch_size=1, global_batch_size=8, island="a",
                        device_type="A100-80GB")


def test_variants_keep_and_drop_the_distributed_optimizer_and_record_the_overlap():
    kept, plain = overlap_variants(dataclasses.replace(PLAN, use_distributed_optimizer=True))
    assert kept.overlap_grad_reduce and kept.use_distributed_optimizer and kept.predicted is None
    assert plain.overlap_grad_reduce and not plain.use_distributed_optimizer and plain.predicted is None
    (only,) = overlap_variants(PLAN)  # no distributed optimizer to keep
    assert only.overlap_grad_reduce and not only.use_distributed_optimizer


def test_no_variant_where_there_is_nothing_the_runtime_would_overlap():
    one = homogeneous_plan(tp=1, pp=2, dp=1, num_layers=4, micro_batch_size=1, global_batch_size=8, island="a",
                           device_type="A100-80GB")
    assert "one replica" in overlap_variants(one)
    assert "already" in overlap_variants(dataclasses.replace(PLAN, overlap_grad_reduce=True))
    inter = dataclasses.replace(PLAN, schedule="interleaved", virtual_pipeline_size=2)
    assert "interleaved" in overlap_variants(inter)


class _Pred:
    def __init__(self, t: float, red: float):
        self.iteration_time_s, self.gradient_reduction_s = t, red


def test_the_note_says_which_form_overlaps_and_what_it_was_compared_with():
    kept, plain = overlap_variants(dataclasses.replace(PLAN, use_distributed_optimizer=True))
    note = overlap_note((kept, _Pred(1.0, 0.01)), _Pred(1.2, 0.2))
    assert "with the distributed optimizer: " in note and "--overlap-param-gather" in note
    assert "the same without overlap (reduce-scatter after the backward) 1.2 s, 0.2 s exposed" in note
    note = overlap_note((plain, _Pred(1.0, 0.01)), _Pred(1.2, 0.2))
    assert "no distributed optimizer" in note and "with the distributed optimizer instead" in note
    assert overlap_note((PLAN, _Pred(1.0, 0.0)), None) == ""


GPT_1_3B = ModelSpec(num_layers=24, hidden_size=2048, num_attention_heads=32, seq_length=2048, vocab_size=50257,
                     name="gpt-1.3b")


def _h100_h200() -> ClusterSpec:
    """4 H100 + 4 H200 at 2400 Gbit/s (tests/unit/planner/test_planner_modes.py's even cluster)."""
    return ClusterSpec(islands=(IslandSpec(name="a", device=CATALOG["H100-SXM"], nodes=1, gpus_per_node=4),
                                IslandSpec(name="b", device=CATALOG["H200"], nodes=1, gpus_per_node=4)),
                       links=(LinkSpec(between=("a", "b"), bandwidth_gbps=2400),))


def test_the_search_chooses_the_overlap_when_it_is_faster_and_says_so():
    """8 one-stage replicas, global batch 16: the whole model's all-reduce after a 2-micro-batch
    backward is worth hiding; with the distributed optimizer kept the Adam step is sharded too, so
    that overlapped form beats the one without it (both fit)."""
    cluster = _h100_h200()
    result = plan_cluster(GPT_1_3B, cluster, global_batch_size=16)
    best = result.best
    assert best.overlap_grad_reduce and best.use_distributed_optimizer
    best.validate(GPT_1_3B, cluster)
    unsharded = predict(dataclasses.replace(best, use_distributed_optimizer=False, predicted=None), GPT_1_3B, cluster)
    assert unsharded.fits and unsharded.iteration_time_s > best.predicted["iteration_time_s"]
    assert unsharded.optimizer_s > best.predicted["optimizer_s"]
    assert "overlapped with each stage's last backward" in result.explanation
    off = plan_cluster(GPT_1_3B, cluster, global_batch_size=16, consider_grad_overlap=False)
    assert not off.best.overlap_grad_reduce
    assert off.best.predicted["iteration_time_s"] > best.predicted["iteration_time_s"]


def test_a_run_that_asks_for_the_distributed_optimizer_gets_no_form_that_drops_it(monkeypatch):
    """pretrain's --hetero-plan auto with --use-distributed-optimizer plans with keep_distributed_optimizer:
    overlapped forms are priced, but only those that keep that optimizer. Here only the dropping form
    is offered (the kept one removed), and it would win without the flag."""
    import megatron_het.planner.search as search

    monkeypatch.setattr(search, "overlap_variants", lambda plan: [v for v in overlap_variants(plan)
                                                                  if not v.use_distributed_optimizer])
    free = plan_cluster(GPT_1_3B, _h100_h200(), global_batch_size=16)
    assert free.best.overlap_grad_reduce and not free.best.use_distributed_optimizer
    kept = plan_cluster(GPT_1_3B, _h100_h200(), global_batch_size=16, keep_distributed_optimizer=True)
    assert all(p.use_distributed_optimizer or len(p.replicas) == 1 for p, _ in kept.candidates)
    assert not kept.best.overlap_grad_reduce
