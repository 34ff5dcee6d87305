"""The seeded full model (runtime/initial_values.py): megatron-core's initialisation, one value per
seed and name whatever the padding, and a rule for every parameter megatron-core builds."""

import math

import pytest
import torch

from megatron_het.cluster import ModelSpec
from megatron_het.runtime.initial_values import SeededFullState, init_kind, param_seed

GPT = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=200)
LLAMA = ModelSpec(num_layers=6, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=32,
                  vocab_size=200, swiglu=True, untie_embeddings_and_output_weights=True)


def _megatron_built(model: ModelSpec, padded_vocab: int) -> dict[str, torch.Tensor]:
    """megatron-core's own initial values of the whole model at TP = 1 (its init methods, its RNG)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_het.model.gpt import StageModelSpec, build_gpt_stage, transformer_config
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.holdings import _any_world, global_params

    enable_cpu_backend()
    spec = StageModelSpec(model=model, num_layers=model.num_layers, layer_offset=0, tp=1, pre_process=True,
                          post_process=True, vocab_size=padded_vocab)
    with _any_world():
        import torch.distributed as dist

        one = dist.new_group([0])
        pgc = ProcessGroupCollection(tp=one, pp=one, cp=one, tp_cp=one, dp=one, dp_cp=one, embd=one, pos_embd=one,
                                     ep=one, expt_tp=one, expt_dp=one, tp_ep=one, tp_ep_pp=one, mp=one)
        torch.manual_seed(3)
        model_parallel_cuda_manual_seed(3, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
        gpt = build_gpt_stage(spec, transformer_config(spec), pgc)
        return {n: p.detach().clone() for n, p in
                global_params([(gpt, 0)], tied=not model.untie_embeddings_and_output_weights).items()}


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
def test_every_parameter_follows_megatron_cores_initialisation(model):
    """Same kind per parameter as megatron-core draws: ones and zeros exactly, normals with its std
    (init_method_std 0.02; the output projections 0.02 / sqrt(2 x the model's layers)) within the
    sampling error of their sizes (4 standard errors)."""
    theirs = _megatron_built(model, 256)
    ours = SeededFullState(model, seed=3, padded_vocab=256)
    assert set(ours) == set(theirs)
    expected_std = {"embedding": 0.02, "weight": 0.02, "output": 0.02 / math.sqrt(2 * model.num_layers)}
    for name, value in theirs.items():
        mine = ours[name]
        assert mine.shape == value.shape and mine.dtype == torch.float32, name
        kind = init_kind(name)
        if kind in ("zeros", "ones"):
            assert torch.equal(mine, value), name
            continue
        std = expected_std[kind]
        tol = 4 * std / math.sqrt(2 * value.numel())  # standard error of a sample std
        assert abs(float(value.std()) - std) < tol, f"megatron-core's {name} is not {kind} ({value.std():.5f})"
        assert abs(float(mine.std()) - std) < tol, f"{name}: std {mine.std():.5f}, megatron-core {std:.5f}"


def test_values_depend_on_seed_and_name_only():
    a = SeededFullState(GPT, seed=7, padded_vocab=256)
    b = SeededFullState(GPT, seed=7, padded_vocab=1024)  # the padding a TP 8 plan asks for
    c = SeededFullState(GPT, seed=8, padded_vocab=256)
    name = "decoder.layers.2.self_attention.linear_qkv.weight"
    assert torch.equal(a[name], SeededFullState(GPT, seed=7, padded_vocab=256)[name])
    assert not torch.equal(a[name], c[name])
    assert not torch.equal(a[name], a["decoder.layers.1.self_attention.linear_qkv.weight"])
    emb = "embedding.word_embeddings.weight"
    assert a[emb].shape == (256, 64) and b[emb].shape == (1024, 64)
    assert torch.equal(a[emb][:200], b[emb][:200])  # the tokenizer's rows do not depend on the padding


def test_drawing_leaves_the_global_generator_alone():
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    SeededFullState(GPT, seed=1, padded_vocab=256)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(torch.rand(3), expected)


def test_seed_is_stable_across_processes_and_names_differ():
    assert param_seed(1234, "output_layer.weight") == param_seed(1234, "output_layer.weight")
    assert param_seed(1234, "a") != param_seed(1234, "b") != param_seed(1235, "b")
    # pinned: Python's salted hash() would change this between processes
    assert param_seed(0, "x") == int.from_bytes(__import__("hashlib").sha256(b"0/x").digest()[:8], "little") & (2**63 - 1)


def test_an_unknown_parameter_is_refused_by_name():
    with pytest.raises(ValueError, match="decoder.layers.0.mlp.router.expert_bias: no plan-independent"):
        init_kind("decoder.layers.0.mlp.router.expert_bias")
    # an MoE layer's router and experts are drawn as megatron-core draws them
    assert init_kind("decoder.layers.0.mlp.router.weight") == "weight"
    assert init_kind("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight") == "weight"
    assert init_kind("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight") == "output"


def test_a_stage_scales_its_output_projections_by_the_models_layers():
    """Megatron-LM's scaled init divides by sqrt(2 x the model's layers); a stage holding 1 of 4
    layers once used its own count (std 0.0141 instead of 0.0071)."""
    from megatron_het.model.gpt import StageModelSpec, transformer_config

    stage = StageModelSpec(model=GPT, num_layers=1, layer_offset=2, tp=1, pre_process=False, post_process=False,
                           vocab_size=256)
    assert transformer_config(stage).output_layer_init_method.keywords["std"] == pytest.approx(0.02 / math.sqrt(8))


@pytest.mark.parametrize("tile", [1024, 24], ids=["one-tile", "many-tiles"])
def test_every_piece_is_the_slice_of_the_full_tensor(monkeypatch, tile):
    """A rank's piece (TP shards, gated halves, a vocabulary shard) drawn from its tiles alone equals
    the same slice of the full tensor: with tiles of 24 (odd splits: 64 = 24 + 24 + 16) as well."""
    from megatron_het.checkpoint.tp_layout import slice_full
    from megatron_het.runtime import initial_values
    from megatron_het.runtime.grad_sync import Holding

    monkeypatch.setattr(initial_values, "TILE", tile)
    init = SeededFullState(LLAMA, seed=5, padded_vocab=256)
    for name, dim in (("decoder.layers.1.mlp.linear_fc1.weight", 0), ("decoder.layers.1.mlp.linear_fc2.weight", 1),
                      ("embedding.word_embeddings.weight", 0), ("output_layer.weight", 0)):
        full = init[name]
        glu = ".linear_fc1." in name
        for tp in (2, 4):
            for r in range(tp):
                h = Holding(name=name, rank=r, stage_key=(0, 0), tp_rank=r, tp_size=tp, partition_dim=dim,
                            full_shape=tuple(full.shape), glu=glu)
                assert torch.equal(init.local(h), slice_full(full, dim, r, tp, glu)), (name, tp, r)


def test_a_value_depends_on_its_position_only(monkeypatch):
    from megatron_het.runtime import initial_values

    monkeypatch.setattr(initial_values, "TILE", 24)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    small = SeededFullState(GPT, seed=5, padded_vocab=256)
    assert not torch.equal(small[name][:24, :24], small[name][24:48, :24])  # tiles are drawn apart
    emb = "embedding.word_embeddings.weight"
    assert torch.equal(small[emb], SeededFullState(GPT, seed=5, padded_vocab=384)[emb][:256])
