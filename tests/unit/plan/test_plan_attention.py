"""A plan records the attention kernel it was priced with, and the predictor, the planner and the
runtime use that one (issue #36, item 3: unfused attention was priced as fused)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_het.cluster import load_cluster, load_model
from megatron_het.model.gpt import layer_spec
from megatron_het.model.sdpa_attention import SdpaAttention
from megatron_het.perf.predict import predict
from megatron_het.plan import Plan, PlanError, homogeneous_plan
from megatron_het.runtime.holdings import stage_model_spec

from support.paths import REPO

H100 = load_cluster(REPO / "examples/clusters/h100-8.yaml")
LLAMA = load_model(REPO / "examples/models/llama2-7b.yaml")


def _h100_plan(**kw) -> Plan:
    plan = homogeneous_plan(tp=1, pp=1, dp=8, num_layers=LLAMA.num_layers, micro_batch_size=1, global_batch_size=64,
                            island="h100-node", device_type="H100-SXM")
    return dataclasses.replace(plan, use_distributed_optimizer=True, **kw)


def test_the_record_round_trips_and_is_left_out_when_unset():
    plan = _h100_plan(attention="unfused")
    assert Plan.from_dict(json.loads(plan.to_json())).attention == "unfused"
    assert "attention" not in _h100_plan().to_dict()  # older plan files keep their bytes
    with pytest.raises(PlanError, match=r"attention.*unknown attention kernel.*'flash'.*fused, unfused"):
        Plan.from_dict({**plan.to_dict(), "attention": "flash"})


def test_unfused_attention_is_priced_as_unfused():
    fused, unfused, default = (predict(_h100_plan(attention=a), LLAMA, H100) for a in ("fused", "unfused", None))
    print(f"7B TP1 on H100, 4k tokens: fused {fused.memory_gib_per_rank_max:.1f} GiB, unfused "
          f"{unfused.memory_gib_per_rank_max:.1f} GiB")
    assert default.memory_gib_per_rank_max == fused.memory_gib_per_rank_max  # GPUs: fused unless recorded
    assert unfused.memory_gib_per_rank_max > fused.memory_gib_per_rank_max + 40  # s x s scores per layer
    assert fused.fits and not unfused.fits
    assert unfused.iteration_time_s > fused.iteration_time_s


def test_the_runtime_builds_the_recorded_kernel():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    def core(plan):
        stage = plan.replicas[0].stages[0]
        spec = stage_model_spec(LLAMA, plan, stage, is_first=True, is_last=True, vocab_size=32000)
        built = layer_spec(LLAMA, fused_attention=spec.fused_attention)
        return built.submodules.self_attention.submodules.core_attention

    assert core(_h100_plan(attention="fused")) is SdpaAttention
    assert core(_h100_plan(attention="unfused")) is DotProductAttention
    assert core(_h100_plan()) is DotProductAttention  # unrecorded on this host (no GPU): the unfused module


def test_the_planner_prices_and_records_the_kernel_asked_for():
    """tools/plan.py --attention unfused (no flash kernel on the nodes): the chosen plan records it and
    fits with the s x s scores counted; its default plan (fused) would not."""
    from megatron_het.planner import plan_cluster

    result = plan_cluster(LLAMA, H100, global_batch_size=64, precision="bf16", attention="unfused", top_k=1)
    best = result.best
    assert best.attention == "unfused"
    pred = predict(best, LLAMA, H100)
    print(f"unfused 7B on 8 x H100: {best.describe()[0]}; {pred.memory_gib_per_rank_max:.1f} GiB")
    assert pred.fits
    assert not predict(dataclasses.replace(_h100_plan(), attention="unfused"), LLAMA, H100).fits


def test_predict_may_add_the_record_but_not_contradict_it(tmp_path, capsys):
    from megatron_het.cli.predict import main

    path = tmp_path / "plan.json"
    _h100_plan(attention="fused").save(path)
    common = ["--cluster", str(REPO / "examples/clusters/h100-8.yaml"), "--model",
              str(REPO / "examples/models/llama2-7b.yaml"), "--plan", str(path)]
    with pytest.raises(SystemExit) as exit_:
        main([*common, "--attention", "unfused"])
    assert exit_.value.code == 2
    assert "the plan records attention 'fused'" in capsys.readouterr().err
    _h100_plan().save(path)
    assert main([*common, "--attention", "unfused"]) == 0
    assert "attention unfused" in capsys.readouterr().out
