"""megatron-het adapter: a gated MLP's fc1 is read and written as the trainer stores it (its .gate and .up
halves, dist_ckpt.TensorSlot.glu), and the neutral form holds megatron-core's [gate; up]."""

from __future__ import annotations

import pytest
import torch

from megatron_het.checkpoint.convert import ConvertError, ModelState, expected_shapes, read_het, write_het
from megatron_het.checkpoint.convert.io import atomic_output_dir, single_process_group
from megatron_het.cluster import ModelSpec

LLAMA = ModelSpec(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24,
                  seq_length=8, vocab_size=50, swiglu=True, untie_embeddings_and_output_weights=True)
FC1 = "decoder.layers.1.mlp.linear_fc1.weight"


def _state(model: ModelSpec = LLAMA) -> ModelState:
    g = torch.Generator().manual_seed(0)
    return ModelState(model=model, tensors={n: torch.randn(s, generator=g) for n, s in expected_shapes(model).items()})


def _metadata(path) -> dict:
    from megatron_het.checkpoint.safe_read import load_tensor_metadata

    return load_tensor_metadata(str(path))


def _save(root, state: ModelState, *, glu: bool, converted: bool = True) -> str:
    """A het checkpoint of ``state`` with the gated fc1 stored whole (``glu`` False: as convert.py wrote it
    before it stored the trainer's layout) or as its halves."""
    from megatron_het.checkpoint.convert.state import VOCAB_ROWS, pad_vocab
    from megatron_het.checkpoint.dist_ckpt import TensorSlot, model_common_state, save_checkpoint

    tensors = {n: pad_vocab(t, 128, name=n) if n in VOCAB_ROWS else t for n, t in state.tensors.items()}
    slots = {n: TensorSlot(tensor=t, partition_dim=0 if glu and ".linear_fc1." in n else None, tp_rank=0, tp_size=1,
                           main=True, glu=glu and ".linear_fc1." in n) for n, t in tensors.items()}
    moments = {n: {"exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)} for n, t in tensors.items()}
    common = {"model": model_common_state(state.model), "padded_vocab": 128, "plan": None}
    if converted:
        common["converted"] = True
    save = str(root / "save")
    with single_process_group():
        save_checkpoint(save, 3, params=slots, optimizer_state=moments, common=common)
    return save


def test_written_as_the_trainer_stores_it_and_read_back_exactly(tmp_path):
    state = _state()
    out = tmp_path / "het"
    with atomic_output_dir(str(out)) as tmp:
        write_het(state, tmp)
    meta = _metadata(out / "iter_0000000")
    assert "model." + FC1 not in meta
    gate, up = meta[f"model.{FC1}.gate"], meta[f"model.{FC1}.up"]
    assert tuple(gate.global_shape) == tuple(up.global_shape) == (24, 16)
    assert f"optimizer.exp_avg.{FC1}.gate" in meta  # the moments too: pretrain_gpt.py --load reads them
    back = read_het(str(out))
    assert set(back.tensors) == set(state.tensors)
    for name, tensor in state.tensors.items():
        assert torch.equal(back.tensors[name], tensor), name


def test_trainer_halves_join_into_gate_then_up(tmp_path):
    state = _state()
    back = read_het(_save(tmp_path, state, glu=True, converted=False))  # as pretrain_gpt.py writes it
    gate, up = torch.chunk(state.tensors[FC1], 2, dim=0)
    assert torch.equal(back.tensors[FC1][:24], gate) and torch.equal(back.tensors[FC1][24:], up)


def test_earlier_converter_output_with_a_whole_fc1_is_still_read(tmp_path):
    state = _state()
    back = read_het(_save(tmp_path, state, glu=False, converted=True))
    assert all(torch.equal(back.tensors[n], t) for n, t in state.tensors.items())


def test_whole_fc1_from_a_trainer_is_refused_naming_the_half(tmp_path):
    """Only convert.py wrote a gated fc1 whole (TP=1, [gate; up]); from anything else the layout is not known."""
    with pytest.raises(ConvertError, match=r"missing tensor 'decoder.layers.0.mlp.linear_fc1.weight.gate' \(and 3 "
                                           r"more\) for a 2-layer model .*\.gate and \.up halves"):
        read_het(_save(tmp_path, _state(), glu=False, converted=False))
