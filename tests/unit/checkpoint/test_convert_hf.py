"""Hugging Face adapter: QKV reorder, name/transpose mapping, exact round trips, errors, files."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from megatron_het.checkpoint.convert import (
    ConvertError,
    ModelState,
    check_state,
    expected_shapes,
    from_hf,
    fuse_qkv,
    hf_config,
    model_from_hf_config,
    read_hf,
    split_qkv,
    to_hf,
    write_hf,
)
from megatron_het.checkpoint.convert.io import atomic_output_dir, counted
from megatron_het.cluster import ModelSpec

GPT = ModelSpec(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8, vocab_size=50)
LLAMA = ModelSpec(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24,
                  seq_length=8, vocab_size=50, swiglu=True, untie_embeddings_and_output_weights=True)


def random_state(model: ModelSpec, seed: int = 0) -> ModelState:
    g = torch.Generator().manual_seed(seed)
    return ModelState(model=model, tensors={n: torch.randn(s, generator=g) for n, s in expected_shapes(model).items()})


def test_split_qkv_takes_heads_per_query_group():
    # 4 heads in 2 groups, d = 4: rows are [q0 q1 k0 v0 | q2 q3 k1 v1], each head 4 rows.
    d = LLAMA.kv_channels
    labels = ["q0", "q1", "k0", "v0", "q2", "q3", "k1", "v1"]
    fused = torch.tensor([[float(i)] for i, _ in enumerate(labels) for _ in range(d)])
    q, k, v = split_qkv(fused, LLAMA)
    head = lambda t, i: int(t[i * d, 0])  # noqa: E731
    assert [labels[head(q, i)] for i in range(4)] == ["q0", "q1", "q2", "q3"]
    assert [labels[head(k, i)] for i in range(2)] == ["k0", "k1"]
    assert [labels[head(v, i)] for i in range(2)] == ["v0", "v1"]
    assert torch.equal(fuse_qkv(q, k, v, LLAMA), fused)


def test_gpt2_mapping_transposes_conv1d_and_unfuses_qkv():
    state = random_state(GPT)
    hf = to_hf(state)
    t = state.tensors
    assert torch.equal(hf["transformer.h.1.mlp.c_fc.weight"], t["decoder.layers.1.mlp.linear_fc1.weight"].t())
    assert hf["transformer.h.0.attn.c_attn.weight"].shape == (16, 48)  # Conv1D: [in, 3h]
    q, k, v = split_qkv(t["decoder.layers.0.self_attention.linear_qkv.weight"], GPT)
    assert torch.equal(hf["transformer.h.0.attn.c_attn.weight"][:, 16:32], k.t())
    assert torch.equal(hf["transformer.h.0.attn.c_attn.bias"][32:],
                       split_qkv(t["decoder.layers.0.self_attention.linear_qkv.bias"], GPT)[2])
    assert "lm_head.weight" not in hf  # tied
    assert hf["transformer.wte.weight"].shape == (50, 16)


def test_llama_mapping_splits_gate_and_up():
    state = random_state(LLAMA)
    hf = to_hf(state)
    fc1 = state.tensors["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(hf["model.layers.0.mlp.gate_proj.weight"], fc1[:24])
    assert torch.equal(hf["model.layers.0.mlp.up_proj.weight"], fc1[24:])
    assert hf["model.layers.0.self_attn.k_proj.weight"].shape == (8, 16)  # 2 kv heads x 4
    assert torch.equal(hf["lm_head.weight"], state.tensors["output_layer.weight"])
    assert torch.equal(hf["model.layers.1.post_attention_layernorm.weight"],
                       state.tensors["decoder.layers.1.pre_mlp_layernorm.weight"])


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt2", "llama"])
def test_round_trip_is_exact(model):
    state = random_state(model, seed=3)
    back = from_hf(to_hf(state), model)
    assert set(back.tensors) == set(state.tensors)
    for name, tensor in state.tensors.items():
        assert torch.equal(back.tensors[name], tensor), name


def test_original_gpt2_names_are_accepted():
    hf = {k.removeprefix("transformer."): v for k, v in to_hf(random_state(GPT)).items()}
    hf["h.0.attn.bias"] = torch.ones(1, 1, 8, 8)  # causal-mask buffer of old checkpoints
    back = from_hf(hf, GPT)
    assert torch.equal(back.tensors["embedding.word_embeddings.weight"], hf["wte.weight"])


def test_missing_and_unexpected_tensors_are_named():
    hf = to_hf(random_state(LLAMA))
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ConvertError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        from_hf(hf, LLAMA)
    hf = to_hf(random_state(LLAMA))
    hf["model.layers.2.input_layernorm.weight"] = torch.ones(16)
    with pytest.raises(ConvertError, match=r"unexpected tensor 'model.layers.2.input_layernorm.weight' \(1 left"):
        from_hf(hf, LLAMA)
    hf = to_hf(random_state(LLAMA))
    hf["model.layers.0.self_attn.k_proj.weight"] = torch.ones(16, 16)
    with pytest.raises(ConvertError, match=r"k_proj.weight' has 16 rows, the model needs 8"):
        from_hf(hf, LLAMA)


def test_check_state_names_shape_mismatch():
    tensors = dict(random_state(GPT).tensors)
    tensors["decoder.layers.1.mlp.linear_fc2.weight"] = torch.zeros(16, 32)
    with pytest.raises(ConvertError, match=r"'decoder.layers.1.mlp.linear_fc2.weight' has shape \(16, 32\), "
                                           r"the model needs \(16, 64\)"):
        check_state(ModelState(model=GPT, tensors=tensors), source="ckpt")


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt2", "llama"])
def test_config_round_trip(model):
    assert model_from_hf_config(hf_config(model), seq_length=8) == model


def test_config_refuses_what_the_runtime_cannot_build():
    with pytest.raises(ConvertError, match=r"model_type 'mistral'"):
        model_from_hf_config({"model_type": "mistral"})
    gqa_gpt = ModelSpec(num_layers=1, hidden_size=16, num_attention_heads=4, num_query_groups=2, seq_length=8,
                        vocab_size=50)
    with pytest.raises(ConvertError, match=r"num_query_groups: GPT-2 has no grouped-query attention \(got 2"):
        hf_config(gqa_gpt)


def test_files_round_trip_with_shards(tmp_path):
    state = random_state(LLAMA, seed=5)
    out = tmp_path / "hf"
    with atomic_output_dir(str(out)) as tmp:
        write_hf(state, tmp, max_shard_bytes=4096)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).exists() for f in files)
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2
    back = read_hf(str(out))
    assert back.model == ModelSpec(**{**LLAMA.__dict__, "seq_length": LLAMA.max_position_embeddings})
    assert all(torch.equal(back.tensors[n], t) for n, t in state.tensors.items())


def test_atomic_output_dir(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_output_dir(str(out)) as tmp:
            open(os.path.join(tmp, "half-written"), "w").close()
            raise RuntimeError("interrupted")
    assert not out.exists() and os.listdir(tmp_path) == []
    out.mkdir()
    (out / "x").write_text("keep")
    with pytest.raises(ConvertError, match=r"already exists and is not empty"):
        with atomic_output_dir(str(out)):
            pass
    assert (out / "x").read_text() == "keep"


def test_counted_reports_each_item_without_printing(capsys):
    calls = []
    assert list(counted(range(3), 3, lambda done, total: calls.append((done, total)))) == [0, 1, 2]
    assert calls == [(1, 3), (2, 3), (3, 3)]
    assert list(counted("ab", 2, None)) == ["a", "b"]
    assert capsys.readouterr().err == ""


def test_convert_reports_each_phase_to_its_total(tmp_path, capsys):
    from megatron_het.checkpoint.convert import ConvertRequest, convert

    state = random_state(LLAMA, seed=6)
    src = tmp_path / "src"
    with atomic_output_dir(str(src)) as tmp:
        write_hf(state, tmp, max_shard_bytes=4096)
    n_hf = len(to_hf(state))
    calls: dict[str, list] = {}

    def phase(label):
        calls[label] = []
        return lambda done, total: calls[label].append((done, total))

    convert(ConvertRequest(input=str(src), input_format="hf", output=str(tmp_path / "dst"), output_format="hf"),
            progress=phase)
    assert list(calls) == ["read hf", "write hf"]  # one count per phase, in order
    for label, seen in calls.items():
        dones = [d for d, _ in seen]
        assert dones == sorted(dones) and all(d <= t for d, t in seen), label
        assert seen[-1] == (n_hf, n_hf), label  # each phase reaches its own total
    assert capsys.readouterr().err == ""  # the library does not print


# Rotary settings in every spelling config.json has: transformers < 5 (top-level rope_theta, rope_scaling
# with "rope_type" or the older "type") and transformers 5 (rope_parameters). ModelSpec has a rotary base
# but no scaling or partial factor: those are refused naming the field.
@pytest.mark.parametrize(("extra", "field", "value"), [
    ({"rope_theta": 5e5 + 0.5}, "rope_theta", "500000.5"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8}},
     "rope_parameters.rope_type", "'llama3'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.rope_type", "'llama3'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type", "'linear'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor", "0.5"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}},
     "rope_parameters.partial_rotary_factor", "0.25"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
     "rope_parameters.full_attention", "{"),
    ({"rope_parameters": "default"}, "rope_parameters", "'default'"),
])
def test_rotary_settings_the_runtime_does_not_build_are_refused_by_name(extra, field, value):
    with pytest.raises(ConvertError) as e:
        model_from_hf_config(hf_config(LLAMA) | extra, source="m/config.json")
    assert str(e.value).startswith(f"m/config.json: {field}: "), str(e.value)
    assert f"(got {value}" in str(e.value) and "Fix: " in str(e.value), str(e.value)


@pytest.mark.parametrize("extra", [
    {"rope_theta": 10000},
    {"rope_scaling": None},
    {"rope_scaling": {"rope_type": "default"}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}},
])
def test_default_rotary_is_accepted_in_every_spelling(extra):
    assert model_from_hf_config(hf_config(LLAMA) | extra, seq_length=8) == LLAMA


@pytest.mark.parametrize("extra", [
    {"rope_theta": 500000.0},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    {"rope_scaling": {"rope_type": "default", "rope_theta": 5e5}},
])
def test_a_llama_3_rotary_base_is_read_in_every_spelling(extra):
    assert model_from_hf_config(hf_config(LLAMA) | extra, seq_length=8).rotary_base == 500000


def test_rotary_as_transformers_writes_it():
    """config.json as transformers itself writes it (5.x: rope_parameters) from our export's config, and
    from a Llama-3-style config (rope_theta 500000) and a Llama-3.1-style one (llama3 scaling)."""
    from transformers import LlamaConfig

    ours = LlamaConfig.from_dict(hf_config(LLAMA)).to_dict()
    assert model_from_hf_config(ours, seq_length=8) == LLAMA
    llama3 = dataclasses.replace(LLAMA, rotary_base=500000, layernorm_epsilon=1e-6, kv_channels=8)
    assert model_from_hf_config(LlamaConfig.from_dict(hf_config(llama3)).to_dict(), seq_length=8) == llama3
    scaled = hf_config(LLAMA) | {"max_position_embeddings": 64, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}}
    with pytest.raises(ConvertError, match=r"rope_type: rotary scaling is not implemented.* \(got 'llama3'\)"):
        model_from_hf_config(LlamaConfig.from_dict(scaled).to_dict())


@pytest.mark.parametrize(("model", "key"), [(LLAMA, "rms_norm_eps"), (GPT, "layer_norm_epsilon")])
def test_norm_epsilon_is_the_models(model, key):
    assert model_from_hf_config(hf_config(model) | {key: 1e-6}, source="cfg").layernorm_epsilon == 1e-6
    with pytest.raises(ConvertError, match=rf"^cfg: {key}: must be a positive number \(got 'x'\)"):
        model_from_hf_config(hf_config(model) | {key: "x"}, source="cfg")
