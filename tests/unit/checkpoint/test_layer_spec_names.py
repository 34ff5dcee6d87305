"""State in both megatron-core layer-spec namings maps to the same global names (issue #14 item 2).

The transformer-engine spec fuses each layer norm into the following linear layer
(``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``); the local spec
keeps them apart (``input_layernorm.weight``, ``pre_mlp_layernorm.weight``). transformer-engine is
not installable here, so the TE-named stage is a module tree carrying exactly those parameter names and
TP attributes; the local-named one is the same tensors under the local spec's names.
"""

from __future__ import annotations

import torch

from megatron_het.checkpoint.full_state import global_name, load_full_state, local_shards

HIDDEN, FFN = 8, 16
# (local spec name, transformer-engine spec name, shape, partition dim under TP)
LAYER_PARAMS = [
    ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight", (HIDDEN,), None),
    ("input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias", (HIDDEN,), None),
    ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.weight", (3 * HIDDEN, HIDDEN), 0),
    ("self_attention.linear_proj.weight", "self_attention.linear_proj.weight", (HIDDEN, HIDDEN), 1),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight", (HIDDEN,), None),
    ("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias", (HIDDEN,), None),
    ("mlp.linear_fc1.weight", "mlp.linear_fc1.weight", (FFN, HIDDEN), 0),
    ("mlp.linear_fc2.weight", "mlp.linear_fc2.weight", (HIDDEN, FFN), 1),
]


def _stage(names_and_shapes, *, tp: int) -> torch.nn.Module:
    """A module tree whose named_parameters() are exactly the given names (TP-sharded shapes)."""
    root = torch.nn.Module()
    for name, shape, dim in names_and_shapes:
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        local = list(shape)
        if dim is not None:
            local[dim] //= tp
        param = torch.nn.Parameter(torch.zeros(local))
        if dim is not None:
            param.tensor_model_parallel, param.partition_dim = True, dim
        node.register_parameter(leaf, param)
    return root


def _names(spec: int, layers: int = 2):
    return [(f"decoder.layers.{i}.{p[spec]}", p[2], p[3]) for i in range(layers) for p in LAYER_PARAMS]


def test_transformer_engine_names_map_to_the_local_specs_global_names():
    for local, te, _shape, _dim in LAYER_PARAMS:
        assert global_name(f"decoder.layers.1.{te}", 4) == f"decoder.layers.5.{local}"
        assert global_name(f"decoder.layers.1.{local}", 4) == f"decoder.layers.5.{local}"
    assert global_name("decoder.final_layernorm.weight", 4) == "decoder.final_layernorm.weight"


def test_a_stage_in_either_naming_loads_and_saves_the_same_full_state():
    torch.manual_seed(0)
    offset, tp = 3, 2
    full = {f"decoder.layers.{i + offset}.{local}": torch.randn(shape)
            for i in range(2) for local, _te, shape, _dim in LAYER_PARAMS}
    shards = {}
    for spec in (0, 1):  # 0: local spec names, 1: transformer-engine names
        for tp_rank in range(tp):
            stage = _stage(_names(spec), tp=tp)
            load_full_state(stage, full, layer_offset=offset, tp_rank=tp_rank, tp_size=tp, tied=False)
            shards[spec, tp_rank] = local_shards(stage, layer_offset=offset, tp_rank=tp_rank, tp_size=tp, tied=False)
    for tp_rank in range(tp):
        local, te = shards[0, tp_rank], shards[1, tp_rank]
        assert sorted(te) == sorted(local) == sorted(full)
        for name in full:
            assert torch.equal(te[name].tensor, local[name].tensor), name
            assert te[name].partition_dim == local[name].partition_dim
    # a layer norm is replicated: every TP rank of either naming holds the full tensor
    norm = f"decoder.layers.{offset}.pre_mlp_layernorm.weight"
    assert torch.equal(shards[1, 1][norm].tensor, full[norm])
