"""Megatron's block recomputation (StagePlan.recompute_num_layers): the plan's form and checks, the
megatron-core config it builds, and its price (time and memory) against hand computation from the
plain and the fully recomputing layer."""

import json
from dataclasses import replace

import pytest

from megatron_het.cluster import CATALOG, ClusterSpec, IslandSpec, ModelSpec
from megatron_het.model.gpt import StageModelSpec
from megatron_het.perf import predict
from megatron_het.perf.memory import activation_bytes_per_layer, stage_memory
from megatron_het.perf.predict import stage_cost
from megatron_het.plan import Plan, PlanError, StagePlan, homogeneous_plan

MODEL = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=32000,
                  name="small")
A100 = CATALOG["A100-80GB"]
CLUSTER = ClusterSpec(islands=(IslandSpec(name="a", device=A100, nodes=1, gpus_per_node=8),))


def _plan(n: int, *, recompute: bool = True, v: int = 1, pp: int = 2) -> Plan:
    plan = homogeneous_plan(tp=1, pp=pp, dp=1, num_layers=8, micro_batch_size=1, global_batch_size=8, island="a",
                            device_type="A100-80GB")
    replicas = tuple(replace(r, stages=tuple(replace(s, recompute=recompute, recompute_num_layers=n)
                                             for s in r.stages)) for r in plan.replicas)
    return replace(plan, replicas=replicas, virtual_pipeline_size=v, schedule="interleaved" if v > 1 else "1f1b",
                   precision="bf16")


def test_json_carries_the_count_only_when_given_and_reads_it_back():
    plain, partial = _plan(0), _plan(3)
    assert "recompute_num_layers" not in plain.to_dict()["replicas"][0]["stages"][0]
    assert partial.to_dict()["replicas"][0]["stages"][0]["recompute_num_layers"] == 3
    assert Plan.from_dict(partial.to_dict()) == partial


@pytest.mark.parametrize("n, recompute, words", [
    (-1, True, "must be >= 0"),
    (2, False, "recompute is false"),
    (5, True, "exceeds the stage's 4 layers"),
])
def test_bad_counts_name_the_stage_the_value_and_the_fix(n, recompute, words):
    with pytest.raises(PlanError) as err:
        _plan(n, recompute=recompute).validate(MODEL, CLUSTER)
    text = str(err.value)
    assert "stages[0].recompute_num_layers" in text and words in text and str(n) in text
    assert "Fix:" in text or "fix" in text.lower()


def test_recomputed_layers_count_each_model_chunk():
    st = StagePlan(island="a", device_type="A100-80GB", ranks=(0,), layers=(0, 6), recompute=True,
                   recompute_num_layers=2)
    assert st.recomputed_layers(1) == 2
    assert st.recomputed_layers(2) == 4  # two chunks of 3: the first 2 of each
    assert st.recomputed_layers(3) == 6  # three chunks of 2: all of them
    uneven = replace(st, chunk_layers=((0, 1), (4, 9)))  # chunks of 1 and 5 layers
    assert uneven.recomputed_layers(2) == 1 + 2
    assert replace(st, recompute_num_layers=0).recomputed_layers(2) == 6
    assert replace(st, recompute=False).recomputed_layers(1) == 0


def test_megatron_config_uses_the_block_method_for_a_count_and_uniform_for_all():
    from megatron_het.model.gpt import transformer_config

    spec = StageModelSpec(model=MODEL, num_layers=4, layer_offset=0, tp=1, pre_process=True, post_process=False,
                          vocab_size=32000, recompute=True, recompute_num_layers=3)
    cfg = transformer_config(spec)
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "block", 3)
    cfg = transformer_config(replace(spec, num_layers=2))  # a chunk smaller than the count: all of it
    assert (cfg.recompute_method, cfg.recompute_num_layers) == ("block", 2)
    cfg = transformer_config(replace(spec, recompute_num_layers=0))
    assert (cfg.recompute_method, cfg.recompute_num_layers) == ("uniform", 1)
    assert transformer_config(replace(spec, recompute=False)).recompute_granularity is None


def test_stage_cost_is_the_share_weighted_mean_of_plain_and_recomputing_layers():
    island = CLUSTER.islands[0]
    kw = dict(tp=1, micro_batch_size=1, precision="bf16")
    plain = stage_cost(MODEL, island, recompute="none", **kw)
    full = stage_cost(MODEL, island, recompute="full", **kw)
    assert full.layer_backward_s > plain.layer_backward_s * 1.2  # the recomputed forward is priced
    part = stage_cost(MODEL, island, recompute="full", recompute_share=0.25, **kw)
    assert part.layer_forward_s == pytest.approx(plain.layer_forward_s, rel=1e-12)
    assert part.layer_backward_s == pytest.approx(0.25 * full.layer_backward_s + 0.75 * plain.layer_backward_s,
                                                  rel=1e-12)
    assert part.embedding_backward_s == plain.embedding_backward_s
    assert stage_cost(MODEL, island, recompute="full", recompute_share=0.0, **kw) == plain
    with pytest.raises(ValueError, match="recompute_share"):
        stage_cost(MODEL, island, recompute="full", recompute_share=1.5, **kw)


def test_prediction_adds_one_forward_per_recomputed_layer():
    """Stage 0 of a 2-stage pipeline: its backward per micro-batch grows by exactly one layer's
    forward for each recomputed layer, and recomputing all 4 equals recompute without a count."""
    none = predict(_plan(0, recompute=False), MODEL, CLUSTER)
    layer_fwd = stage_cost(MODEL, CLUSTER.islands[0], tp=1, micro_batch_size=1, precision="bf16").layer_forward_s
    for n in (1, 3):
        part = predict(_plan(n), MODEL, CLUSTER)
        extra = part.replicas[0].stages[0].backward_s - none.replicas[0].stages[0].backward_s
        assert extra == pytest.approx(n * layer_fwd, rel=1e-9), n
        assert none.pipeline_time_s < part.pipeline_time_s
    assert predict(_plan(4), MODEL, CLUSTER).pipeline_time_s == pytest.approx(
        predict(_plan(0), MODEL, CLUSTER).pipeline_time_s, rel=1e-12)


def test_interleaved_chunks_recompute_their_own_first_layers():
    """v=2, stages of 4 layers in chunks of 2: a count of 1 recomputes 2 of the stage's 4 layers."""
    none = predict(_plan(0, recompute=False, v=2), MODEL, CLUSTER)
    part = predict(_plan(1, v=2), MODEL, CLUSTER)
    layer_fwd = stage_cost(MODEL, CLUSTER.islands[0], tp=1, micro_batch_size=1, precision="bf16").layer_forward_s
    extra = part.replicas[0].stages[0].backward_s - none.replicas[0].stages[0].backward_s
    assert extra == pytest.approx(2 * layer_fwd, rel=1e-9)


def test_memory_keeps_full_activations_of_the_layers_left_alone():
    kw = dict(micro_batch_size=1, tp=1, precision="bf16", flash_attention=True)
    full_layer = activation_bytes_per_layer(MODEL, **kw)
    input_only = activation_bytes_per_layer(MODEL, recompute="full", **kw)
    common = dict(num_layers=4, is_first=False, is_last=False, microbatches_in_flight=2, overhead_bytes=0, **kw)
    none = stage_memory(MODEL, **common).activations_bytes
    all_rc = stage_memory(MODEL, recompute="full", **common).activations_bytes
    part = stage_memory(MODEL, recompute="full", recompute_num_layers=1, **common).activations_bytes
    assert none == 2 * 4 * full_layer
    assert all_rc == 2 * 4 * input_only + (full_layer - input_only)  # + the layer being recomputed
    # the 3 later layers are backwarded (and freed) before layer 0 is recomputed: no working-set term
    assert part == 2 * (1 * input_only + 3 * full_layer)
    assert all_rc < part < none
    # the prediction's per-stage memory follows it
    mem = {n: predict(_plan(n), MODEL, CLUSTER).replicas[0].stages[0].memory.activations_bytes for n in (1, 2, 4)}
    assert mem[4] < mem[2] < mem[1]


def test_predict_tool_prices_a_count(capsys, tmp_path):
    from megatron_het.cli.predict import main

    path = tmp_path / "one.yaml"  # the homogeneous form needs a one-island cluster
    path.write_text("islands:\n  - {name: a, device: A100-80GB, nodes: 2, gpus_per_node: 8}\n")
    args = ["--cluster", str(path), "--model", "examples/models/llama2-7b.yaml", "--tp", "2", "--pp", "2",
            "--dp", "4", "--micro-batch-size", "1", "--global-batch-size", "64", "--json"]
    times = {}
    for extra in ((), ("--recompute-num-layers", "8"), ("--recompute-activations",)):
        assert main(args + list(extra)) == 0
        times[extra] = json.loads(capsys.readouterr().out)["pipeline_time_s"]
    none, half, full = times[()], times[("--recompute-num-layers", "8")], times[("--recompute-activations",)]
    assert none < half < full
    # 8 of each stage's 16 layers: half the extra time of recomputing all of them
    assert half - none == pytest.approx(0.5 * (full - none), rel=0.02)
    assert main(args + ["--recompute-num-layers", "17"]) != 0
    assert "exceeds the stage's 16 layers" in capsys.readouterr().err
