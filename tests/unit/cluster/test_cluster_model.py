"""ModelSpec: Megatron defaults, validation, and the example model files."""


import pytest

from megatron_het.cluster import ConfigError, ModelSpec, default_ffn_hidden_size, load_model, model_from_dict

from support.paths import REPO

MODELS = REPO / "examples" / "models"
BASE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 100}


def test_defaults_follow_megatron():
    m = model_from_dict(BASE)
    assert (m.num_query_groups, m.ffn_hidden_size, m.max_position_embeddings, m.kv_channels) == (4, 256, 32, 16)
    assert m.swiglu is False and m.untie_embeddings_and_output_weights is False and m.name is None


def test_swiglu_default_ffn_is_megatron_rounding_down_to_64():
    assert default_ffn_hidden_size(4096, swiglu=True) == 10880  # int(10922.67 / 64) * 64
    assert default_ffn_hidden_size(64, swiglu=True) == 128  # 170.67 -> 128
    assert default_ffn_hidden_size(4096, swiglu=False) == 16384
    assert model_from_dict({**BASE, "hidden_size": 4096, "num_attention_heads": 32, "swiglu": True}).ffn_hidden_size == 10880


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ({"hidden_size": 66}, r"num_attention_heads: hidden_size 66 is not divisible by num_attention_heads 4 \(got 4\)"),
        ({"num_query_groups": 3}, r"num_query_groups: num_attention_heads 4 is not divisible by num_query_groups 3 \(got 3\)\. Fix: .*e\.g\. 2"),
        ({"num_layers": 0}, r"num_layers: must be >= 1 \(got 0\)"),
        ({"vocab_size": "512"}, r"vocab_size: must be an integer, not str \(got '512'\)\. Fix: .*remove the quotes: 512"),
        ({"seq_length": 64.0}, r"seq_length: must be an integer, not float .*without a decimal point"),
        ({"max_position_embeddings": 16}, r"max_position_embeddings: must be >= seq_length 32 \(got 16\)"),
        ({"swiglu": "yes"}, r"swiglu: must be true or false, not str"),
        ({"num_layer": 2}, r"num_layer: unknown key .*did you mean 'num_layers'"),
    ],
)
def test_bad_model_values_are_named(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        model_from_dict({**BASE, **override}, source="m.yaml")


def test_missing_required_key_and_file_prefix():
    data = dict(BASE)
    del data["vocab_size"]
    with pytest.raises(ConfigError, match=r"^m\.yaml: vocab_size: required key is missing \(got None\)\. Fix: add 'vocab_size:'"):
        model_from_dict(data, source="m.yaml")


EXPECTED = {  # name: (layers, hidden, heads, groups, ffn, seq, vocab, swiglu, untied)
    "tiny-cpu": (4, 64, 4, 4, 256, 64, 512, False, False),
    "gpt3-1.3b": (24, 2048, 16, 16, 8192, 2048, 50257, False, False),
    "gpt3-2.7b": (32, 2560, 32, 32, 10240, 2048, 50257, False, False),
    "gpt3-6.7b": (32, 4096, 32, 32, 16384, 2048, 50257, False, False),
    "gpt3-13b": (40, 5120, 40, 40, 20480, 2048, 50257, False, False),
    "gpt3-175b": (96, 12288, 96, 96, 49152, 2048, 50257, False, False),
    "llama2-7b": (32, 4096, 32, 32, 11008, 4096, 32000, True, True),
    "llama2-13b": (40, 5120, 40, 40, 13824, 4096, 32000, True, True),
    "llama2-70b": (80, 8192, 64, 8, 28672, 4096, 32000, True, True),
    "mixtral-8x7b": (32, 4096, 32, 8, 14336, 4096, 32000, True, True),  # and 8 experts, top-2 (below)
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_models_load_with_published_shapes(name):
    m = load_model(MODELS / f"{name}.yaml")
    got = (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size,
           m.seq_length, m.vocab_size, m.swiglu, m.untie_embeddings_and_output_weights)
    assert got == EXPECTED[name]
    assert m.name == name
    assert isinstance(m, ModelSpec)


def test_mixtral_example_has_its_published_experts():
    """Mixtral 8x7B: 8 experts of Mistral-7B's MLP width, top-2, 46.7B parameters in all (Jiang et al. 2024)."""
    from megatron_het.perf.flops import total_parameters

    m = load_model(MODELS / "mixtral-8x7b.yaml")
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.add_bias_linear) == (8, 2, 14336, False)
    assert total_parameters(m) == pytest.approx(46.7e9, rel=0.01)


def test_no_unexpected_example_models():
    assert {p.stem for p in MODELS.glob("*.yaml")} == set(EXPECTED)
