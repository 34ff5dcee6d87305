"""megatron-het checkpoints (any plan) <-> the neutral form.

A megatron-het checkpoint stores every tensor whole under ``model.<global name>`` (dist_checkpointing
assembles the TP slices on load), so reading needs no plan: each tensor is requested at its global
shape. A gated MLP's ``linear_fc1`` is the exception: the trainer stores it as two tensors, its gate
and up halves (``dist_ckpt.TensorSlot.glu``), because a TP shard holds [gate_r; up_r]. Both directions
go through the trainer's own TP=1 slots (``_slot``), so the converter reads and writes exactly what
``pretrain_gpt.py`` writes and reads, and the neutral form gets megatron-core's [gate; up].
Written checkpoints carry zero Adam moments at the given iteration and a one-rank plan, so
``pretrain_gpt.py --load`` resumes them under any plan (it takes the padded vocabulary from them).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

import torch

from megatron_het.checkpoint.convert.errors import ConvertError
from megatron_het.checkpoint.convert.io import counted, single_process_group
from megatron_het.checkpoint.convert.state import (
    VOCAB_ROWS,
    ModelState,
    check_state,
    expected_shapes,
    pad_vocab,
    unpad_vocab,
)
from megatron_het.checkpoint.tp_layout import is_glu
from megatron_het.cluster import ModelSpec
from megatron_het.utils.progress import ProgressCallback

if TYPE_CHECKING:
    from megatron_het.checkpoint.dist_ckpt import TensorSlot

PREFIX = "model."
GLU_DIM = 0  # linear_fc1 is column-parallel: its [gate; up] halves split the output rows


def checkpoint_dir(path: str) -> str:
    """``SAVE/`` (with a tracker file) -> its latest ``iter_XXXXXXX``; an iteration dir -> itself."""
    from megatron_het.checkpoint.dist_ckpt import TRACKER, iteration_dir, latest_iteration, resolve_iteration_dir

    if os.path.exists(os.path.join(path, TRACKER)):
        return resolve_iteration_dir(iteration_dir(path, latest_iteration(path)))
    if os.path.exists(os.path.join(path, "metadata.json")):
        return path
    raise ConvertError(f"{path}: neither a checkpoint directory ({TRACKER}) nor an iter_XXXXXXX directory. "
                       f"Fix: point --input at the --save directory of the run")


def is_het_checkpoint(path: str) -> bool:
    """Whether ``path`` (a --save directory or an iteration directory) holds a megatron-het checkpoint:
    its verified common state names the format. For the fix of a reader given the wrong --input-format."""
    from megatron_het.checkpoint.dist_ckpt import FORMAT
    from megatron_het.checkpoint.safe_read import load_common_state
    from megatron_het.errors import UserError

    try:
        src = checkpoint_dir(path)
        with single_process_group():
            return load_common_state(src).get("format") == FORMAT
    except (UserError, OSError):
        return False


def read_het(path: str, *, model: ModelSpec | None = None, progress: ProgressCallback | None = None) -> ModelState:
    """Weights of the latest (or the given) iteration, and its ``tokenizer.model`` when it keeps one;
    optimizer moments are not converted."""
    from megatron_het.checkpoint.dist_ckpt import TOKENIZER_FILE, _local, _sharded, check_model_matches, read_common
    from megatron_het.checkpoint.safe_read import load_sharded, load_tensor_metadata, verify_checkpoint

    src = checkpoint_dir(path)
    verify_checkpoint(src)  # before the process group: no code from the checkpoint runs, damage is named
    with single_process_group():
        common = read_common(src)
        saved = _saved_model(common, src)
        if model is not None:
            check_model_matches(common, model, src, fix="drop --model (a megatron-het checkpoint records its "
                                                        "model), or pass the model file it was trained with")
        model = model or saved
        if model.is_moe:  # the formats' expert layouts (HF Mixtral, Megatron's grouped experts) are not mapped yet
            raise ConvertError(f"{src}: a mixture-of-experts checkpoint ({model.num_experts} experts per MoE layer) "
                               "cannot be converted yet (#37). Fix: resume it with pretrain_gpt.py --load, which "
                               "reads it under any plan")
        meta = load_tensor_metadata(src)
        slots = _stored_slots(model, meta, converted=bool(common.get("converted")), src=src)
        request = _sharded(slots, PREFIX)  # the trainer's keys: a gated fc1 as its two halves
        loaded = load_sharded(request, src)
    tensors: dict[str, torch.Tensor] = {}
    for name in counted(slots, len(slots), progress):
        tensor = _local(loaded, PREFIX + name, slots[name])  # the trainer's join: [gate; up]
        tensors[name] = unpad_vocab(tensor, model.vocab_size, name=name) if name in VOCAB_ROWS else tensor
    tokenizer = os.path.join(src, TOKENIZER_FILE)  # kept by save_checkpoint(tokenizer_model=...)
    state = ModelState(model=model, tensors=tensors, iteration=int(common.get("iteration", 0)),
                       tokenizer_model=tokenizer if os.path.isfile(tokenizer) else None)
    check_state(state, source=src)
    return state


def _slot(name: str, tensor: torch.Tensor, model: ModelSpec, *, glu: bool | None = None) -> TensorSlot:
    """A full tensor as the trainer stores it from a one-rank stage: whole, or for the gated MLP's fc1
    (column-parallel: split along its output rows) as its gate and up halves."""
    from megatron_het.checkpoint.dist_ckpt import TensorSlot

    glu = is_glu(name, model.swiglu) if glu is None else glu
    return TensorSlot(tensor=tensor, partition_dim=GLU_DIM if glu else None, tp_rank=0, tp_size=1, main=True, glu=glu)


def _stored_slots(model: ModelSpec, meta: dict, *, converted: bool, src: str) -> dict[str, TensorSlot]:
    """Every tensor of ``model`` as a slot to load into, at the dtype it was stored in (vocabulary rows:
    as padded in the checkpoint). A stored key missing, of another shape, or left over is named."""
    from megatron_het.checkpoint.dist_ckpt import _sharded

    slots: dict[str, TensorSlot] = {}
    wanted: dict[str, tuple[int, ...]] = {}  # stored key -> global shape
    first_key: dict[str, str] = {}  # name -> one of its stored keys (a gated fc1's halves share a dtype)
    for name, shape in expected_shapes(model).items():
        whole = PREFIX + name
        if name in VOCAB_ROWS and whole in meta:
            shape = (meta[whole].global_shape[0], *shape[1:])  # padded for the writer's TP: unpadded on read
        # before it stored the trainer's layout, convert.py wrote a gated fc1 whole, as [gate; up] (TP=1)
        glu = is_glu(name, model.swiglu) and not (converted and whole in meta)
        slots[name] = _slot(name, torch.empty(shape, device="meta"), model, glu=glu)
        keys = {k: tuple(t.global_shape) for k, t in _sharded({name: slots[name]}, PREFIX).items()}
        wanted.update(keys)
        first_key[name] = next(iter(keys))
    missing = [k for k in wanted if k not in meta]
    if missing:
        glu = ", a gated MLP's linear_fc1 as its .gate and .up halves" if model.swiglu else ""
        raise ConvertError(f"{src}: missing tensor {missing[0][len(PREFIX):]!r} (and {len(missing) - 1} more) for a "
                           f"{model.num_layers}-layer model (stored as pretrain_gpt.py stores it{glu}). Fix: check "
                           f"that the checkpoint is complete and that --model describes it (num_layers, swiglu, "
                           f"untie_embeddings_and_output_weights...)")
    for key, shape in wanted.items():
        if tuple(meta[key].global_shape) != shape:
            raise ConvertError(f"{src}: tensor {key[len(PREFIX):]!r} has shape {tuple(meta[key].global_shape)}, the "
                               f"model needs {shape}. Fix: use the model description the checkpoint was trained with")
    extra = sorted(k[len(PREFIX):] for k in meta if k.startswith(PREFIX) and k not in wanted)
    if extra:
        raise ConvertError(f"{src}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all). Fix: the model "
                           f"description does not match the checkpoint (e.g. tied vs untied output layer, swiglu), "
                           f"pass the right --model")
    return {name: dataclasses.replace(slot, tensor=torch.empty(slot.tensor.shape, dtype=meta[first_key[name]].dtype))
            for name, slot in slots.items()}


def _saved_model(common: dict, src: str) -> ModelSpec:
    """The model a het checkpoint records (its common state is untrusted input)."""
    try:
        return ModelSpec(**common["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConvertError(f"{src}: the checkpoint's model description is unusable ({e}). Fix: pass --model M.yaml "
                           f"describing the checkpoint, or re-save it") from None


def write_het(state: ModelState, save_dir: str, *, tp: int = 1, pp: int = 1,
              progress: ProgressCallback | None = None) -> str:
    """A megatron-het checkpoint (``save_dir/iter_XXXXXXX`` + tracker); returns the iteration dir.

    ``tp``/``pp`` only shape the recorded plan and the vocabulary padding (a multiple of 128 * tp);
    the checkpoint loads under any plan whose padding matches (pretrain_gpt.py adopts it). The
    state's tokenizer model is kept in the iteration directory as ``tokenizer.model``.
    """
    from megatron_het.checkpoint.dist_ckpt import model_common_state, save_checkpoint
    from megatron_het.perf.flops import padded_vocab_size
    from megatron_het.plan import homogeneous_plan

    check_state(state, source="input")
    m = state.model
    padded = padded_vocab_size(m.vocab_size, tp=tp)
    plan = homogeneous_plan(tp=tp, pp=pp, dp=1, num_layers=m.num_layers, micro_batch_size=1, global_batch_size=1)
    slots, moments = {}, {}
    if progress is not None:
        progress(0, len(state.tensors))
    for name, tensor in state.tensors.items():
        full = pad_vocab(tensor, padded, name=name) if name in VOCAB_ROWS else tensor
        slots[name] = _slot(name, full.contiguous(), m)  # a gated fc1 as the trainer stores it
        moments[name] = {"exp_avg": torch.zeros_like(full), "exp_avg_sq": torch.zeros_like(full)}
    common = {"model": model_common_state(m), "padded_vocab": padded, "consumed_samples": 0,
              "plan": plan.to_dict(), "converted": True}
    with single_process_group():
        final = save_checkpoint(save_dir, state.iteration, params=slots, optimizer_state=moments, common=common,
                                tokenizer_model=state.tokenizer_model)
    if progress is not None:  # one save writes every tensor: counted once it is on disk
        progress(len(state.tensors), len(state.tensors))
    return final
