"""``runtime/holdings.plan_holdings`` without processes: one meta build per distinct stage shape, global
names across interleaved chunks, and no process group left behind. (Equality with what real ranks
gather: tests/multiproc/test_plan_holdings.py.)"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

import megatron_het.runtime.holdings as holdings
from megatron_het.cluster import ModelSpec
from megatron_het.plan import homogeneous_plan
from megatron_het.runtime.holdings import chunk_model_specs, plan_holdings, stage_model_spec

MODEL = ModelSpec(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=200)


def test_each_stage_shape_is_built_once_and_no_group_is_left(monkeypatch):
    plan = homogeneous_plan(tp=2, pp=2, dp=64, num_layers=8, micro_batch_size=1, global_batch_size=64)
    builds = []
    real = holdings._build_meta

    def counting(specs, **kwargs):
        builds.append((specs[0].layer_offset, kwargs["tp_rank"]))
        return real(specs, **kwargs)

    monkeypatch.setattr(holdings, "_build_meta", counting)
    hs = plan_holdings(plan, MODEL)
    assert sorted(builds) == [(0, 0), (0, 1), (4, 0), (4, 1)]  # 2 stages x 2 TP ranks, for 256 ranks
    assert not dist.is_initialized()  # the one-rank world of the builds is gone
    assert sorted({h.rank for h in hs}) == list(range(256))
    last = plan.replicas[0].stages[1].ranks[1]  # replica 0, last stage, TP rank 1: its tied embedding copy
    mine = [h for h in hs if h.rank == last]
    assert {(h.stage_key, h.tp_rank, h.tp_size) for h in mine} == {((0, 1), 1, 2)}
    assert mine[-1].name == "embedding.word_embeddings.weight" and mine[-1].full_shape == (256, 64)


def test_interleaved_chunks_are_named_by_global_layer():
    plan = dataclasses.replace(homogeneous_plan(tp=1, pp=2, dp=1, num_layers=8, micro_batch_size=1,
                                                global_batch_size=4), schedule="interleaved", virtual_pipeline_size=2)
    by_rank = {r: [h.name for h in plan_holdings(plan, MODEL) if h.rank == r] for r in (0, 1)}
    layers = {r: sorted({int(n.split(".")[2]) for n in names if n.startswith("decoder.layers.")})
              for r, names in by_rank.items()}
    assert layers == {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}
    assert by_rank[0][0] == "embedding.word_embeddings.weight" and "decoder.final_layernorm.weight" in by_rank[1]


def test_chunk_specs_put_embedding_and_output_on_the_outer_chunks():
    plan = homogeneous_plan(tp=1, pp=1, dp=1, num_layers=8, micro_batch_size=1, global_batch_size=1)
    spec = stage_model_spec(MODEL, plan, plan.replicas[0].stages[0], is_first=True, is_last=True, vocab_size=256)
    chunks = chunk_model_specs(spec, [(0, 3), (3, 8)])
    assert [(c.layer_offset, c.num_layers, c.pre_process, c.post_process) for c in chunks] == [
        (0, 3, True, False), (3, 5, False, True)]
