"""Plan-independent checkpoints through megatron-core ``dist_checkpointing``.

Every tensor is saved under its *global* name (layers by global index, see ``full_state.py``) as a
``ShardedTensor`` whose offsets say which TP slice a rank holds, so a checkpoint written under one
plan loads under any other: dist_checkpointing reads each rank's slices for the new layout.
Among the ranks holding the same elements (replicas, a stage's TP ranks for replicated tensors,
the last stage's tied copy of the word embedding) exactly one is the main replica (``replica_id``
0) and writes them: the same owner that counts the element in the gradient norm.

Layout follows Megatron-LM: ``SAVE/iter_0000010/`` plus ``SAVE/latest_checkpointed_iteration.txt``.
A checkpoint is written to ``iter_XXXXXXX.tmp`` and renamed when every rank has finished; the
tracker file is replaced atomically after that, so a crash never leaves a half checkpoint behind the
tracker; a re-saved iteration keeps its old copy until the new one is tracked (``publish_iteration``).
Every read goes through ``safe_read`` (no code runs from a checkpoint). Common state (model shape, iteration, consumed samples, padded vocabulary, the plan) is
checked on load: a checkpoint of another model is refused naming the field.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

import megatron_het.platform  # noqa: F401  (triton import guard)
from megatron_het.checkpoint.errors import CheckpointError
from megatron_het.checkpoint.safe_read import load_common_state, load_sharded
from megatron_het.checkpoint.tp_layout import local_pieces
from megatron_het.cluster import ModelSpec
from megatron_het.platform import HOST_DEVICE
from megatron_het.utils.atomic import write_bytes_atomic

TRACKER = "latest_checkpointed_iteration.txt"
TOKENIZER_FILE = "tokenizer.model"  # the run's SentencePiece model, kept with the weights
OLD_SUFFIX = ".old"  # previous copy of a re-saved iteration, kept until the new one is tracked
FORMAT = "megatron-het-checkpoint"
FORMAT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class TensorSlot:
    """One local tensor and where it sits in its full tensor."""

    tensor: torch.Tensor
    partition_dim: int | None  # None: this rank holds the whole tensor
    tp_rank: int
    tp_size: int
    main: bool  # True on exactly one holder of each element: it writes them
    glu: bool = False  # gated-MLP fc1 ([gate_r; up_r]): stored as two tensors, "<name>.gate" and ".up"
    # explicit (axis, fragment index, fragments) per split axis, for a 3D stage's blocks
    # (checkpoint/tp_layout.grid_rank_offsets); None: from partition_dim, tp_rank and tp_size
    offsets: tuple[tuple[int, int, int], ...] | None = None


def iteration_dir(save: str, iteration: int) -> str:
    return os.path.join(save, f"iter_{iteration:07d}")


def latest_iteration(load: str) -> int | None:
    """The iteration recorded in the tracker file, or None when there is no checkpoint."""
    path = os.path.join(load, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        raw = f.read(64)
    text = raw.decode("ascii", errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}. "
                              f"Fix: write the number of a complete iter_XXXXXXX directory into it")
    return int(text)


def _sharded(slots: Mapping[str, TensorSlot], prefix: str, select=lambda name, slot: slot.tensor):
    from megatron.core.dist_checkpointing import ShardedTensor

    out = {}
    for name, slot in slots.items():
        data = select(name, slot)
        offsets = () if slot.partition_dim is None else ((slot.partition_dim, slot.tp_rank, slot.tp_size),)
        if slot.offsets is not None:
            offsets = slot.offsets
        parts = {"": data}
        if slot.glu:  # two regular grids instead of one interleaved one (tp_layout.py)
            gate, up = local_pieces(data, slot.partition_dim, True)
            parts = {".gate": gate, ".up": up}
        for suffix, part in parts.items():
            key = f"{prefix}{name}{suffix}"
            out[key] = ShardedTensor.from_rank_offsets(key, part, *offsets, replica_id=0 if slot.main else 1)
    return out


def _local(loaded: Mapping, key: str, slot: TensorSlot) -> torch.Tensor:
    if slot.glu:
        return torch.cat([loaded[key + ".gate"], loaded[key + ".up"]], dim=slot.partition_dim)
    return loaded[key]


def model_common_state(model: ModelSpec) -> dict:
    return {k: v for k, v in dataclasses.asdict(model).items() if k != "name"}


# Settings a loaded model need not share with the run that saved it: the initial draw's (a loaded
# model has its values already) and dropout (a training choice; Megatron-LM fine-tunes with another)
NOT_COMPARED = ("init_method_std", "hidden_dropout", "attention_dropout",
                # MoE training choices that leave the weights' meaning alone (a resume may switch them)
                "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_token_dispatcher_type", "moe_expert_capacity_factor",
                "moe_pad_expert_input_to_capacity", "moe_token_drop_policy")


def check_model_matches(common: Mapping, model: ModelSpec, path: str, *,
                        fix: str = "use the checkpoint's model settings, or start without --load") -> None:
    """``fix``: what the caller's user should do (pretrain_gpt.py has --load, convert.py --model).
    A checkpoint written before a setting existed was trained with that setting's value of its
    ``swiglu`` recipe (``recipe_of``): compared as such."""
    from megatron_het.cluster.model_spec import ModelSpec, recipe_of

    # a checkpoint written before MoE existed holds a dense model: its MoE fields are the defaults
    dense = {f.name: f.default for f in dataclasses.fields(ModelSpec) if f.name == "num_experts" or f.name.startswith("moe_")}
    saved = {**dense, **recipe_of(bool(common.get("model", {}).get("swiglu", False))), **common.get("model", {})}
    for key, value in model_common_state(model).items():
        if key in NOT_COMPARED:
            continue
        if key in saved and saved[key] != value:
            raise CheckpointError(
                f"{path}: model.{key}: the checkpoint was trained with {key}={saved[key]!r}, this run has "
                f"{key}={value!r}. Fix: {fix}")


def read_common(path: str) -> dict:
    path = resolve_iteration_dir(path)
    common = load_common_state(path)  # verified first: no code runs from the checkpoint
    if common.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a megatron-het checkpoint (format {common.get('format')!r}). "
                              f"Fix: convert it with tools/checkpoint/convert.py or point --load elsewhere")
    if common.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {common.get('version')} is not supported "
                              f"(this build reads {FORMAT_VERSION})")
    return common


def save_checkpoint(save: str, iteration: int, *, params: Mapping[str, TensorSlot],
                    optimizer_state: Mapping[str, Mapping[str, torch.Tensor]], common: Mapping,
                    tokenizer_model: str | None = None) -> str:
    """Collective: every rank calls it. ``optimizer_state[name]`` holds exp_avg/exp_avg_sq (shaped
    like the parameter); ``common`` must be identical on all ranks (iteration, model, ...).
    ``tokenizer_model`` (the run's SentencePiece file) is copied into the iteration directory as
    ``tokenizer.model``, so a conversion to Hugging Face exports the tokenizer with the weights; every
    rank reads it first, so a missing file fails on all ranks before any collective."""
    tokenizer = _read_tokenizer(tokenizer_model) if tokenizer_model is not None else None
    from megatron.core import dist_checkpointing

    final = iteration_dir(save, iteration)
    tmp = final + ".tmp"
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(save, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a crashed save
        os.makedirs(tmp)
    dist.barrier()
    state = dict(common)
    state.update(format=FORMAT, version=FORMAT_VERSION, iteration=iteration)
    # Only main replicas take part: holders of the same tensor may be split differently (TP=2 in one
    # replica, TP=4 in another), and dist_checkpointing wants one regular grid per key.
    mains = {name: slot for name, slot in params.items() if slot.main}
    state.update(_sharded(mains, "model."))
    for key in ("exp_avg", "exp_avg_sq"):
        state.update(_sharded(mains, f"optimizer.{key}.", lambda name, _s, k=key: optimizer_state[name][k]))
    from megatron_het.platform import keep_checkpoint_flags_on_host

    keep_checkpoint_flags_on_host()  # its world-wide flags through gloo, not a world-wide NCCL communicator
    dist_checkpointing.save(state, tmp)
    dist.barrier()
    if rank == 0:
        if tokenizer is not None:
            write_bytes_atomic(os.path.join(tmp, TOKENIZER_FILE), tokenizer)
        publish_iteration(save, tmp, iteration)
    dist.barrier()
    return final


def _read_tokenizer(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the tokenizer model to keep with the checkpoint ({e.strerror}). "
                              f"Fix: pass --tokenizer-model with the SentencePiece .model file of the run") from None


def _fsync_dir(path: str) -> None:
    """Make renames inside ``path`` durable (a rename is an update of the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_iteration(save: str, tmp: str, iteration: int) -> None:
    """Rename the finished ``tmp`` to ``iter_XXXXXXX`` and point the tracker at it.

    A re-saved iteration keeps its previous copy until the new one is in place and tracked: the
    old directory is moved aside to ``iter_XXXXXXX.old`` (which the loader falls back to if a crash
    comes between the two renames) and deleted last. Directories are fsynced after the renames.
    """
    final = iteration_dir(save, iteration)
    old = final + OLD_SUFFIX
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)  # a leftover of an earlier interrupted re-save
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(save)
    tracker_tmp = os.path.join(save, TRACKER + ".tmp")
    with open(tracker_tmp, "w", encoding="utf-8") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker_tmp, os.path.join(save, TRACKER))
    _fsync_dir(save)
    shutil.rmtree(old, ignore_errors=True)


def resolve_iteration_dir(path: str) -> str:
    """``path``, or its moved-aside previous copy when a re-save was interrupted between renames."""
    if not os.path.isdir(path) and os.path.isdir(path + OLD_SUFFIX):
        return path + OLD_SUFFIX
    return path


def open_checkpoint(path: str, *, model: ModelSpec) -> tuple[str, dict]:
    """The iteration directory ``path`` resolves to and its common state, checked against ``model``."""
    path = resolve_iteration_dir(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory. Fix: check --load and the tracker file")
    common = read_common(path)
    check_model_matches(common, model, path)
    return path, common


def read_slots(path: str, params: Mapping[str, TensorSlot], *, with_optimizer: bool = True
               ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Collective (one dist_checkpointing load; ``params`` may be empty on some ranks). This rank's
    slots of an opened checkpoint ``path``, read into host memory: (values, optimizer moments)."""
    request = {}

    def host_buffer(_name, slot):  # read into host memory: the caller takes its pieces to the device
        return torch.empty(slot.tensor.shape, dtype=slot.tensor.dtype, device=HOST_DEVICE)

    request.update(_sharded(params, "model.", host_buffer))
    if with_optimizer:
        for key in ("exp_avg", "exp_avg_sq"):
            request.update(_sharded(params, f"optimizer.{key}.", host_buffer))
    # Each rank reads the slices of its own layout (load_sharded names the directory on a mismatch).
    loaded = load_sharded(request, path, verified=True)  # open_checkpoint verified the directory
    values = {name: _local(loaded, f"model.{name}", slot) for name, slot in params.items()}
    moments = ({name: {k: _local(loaded, f"optimizer.{k}.{name}", slot) for k in ("exp_avg", "exp_avg_sq")}
                for name, slot in params.items()} if with_optimizer else {})
    return values, moments


def load_checkpoint(path: str, *, params: Mapping[str, TensorSlot], model: ModelSpec,
                    with_optimizer: bool = True) -> tuple[dict, dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Collective. Returns (common state, parameter values, optimizer moments) for this rank's slots."""
    path, common = open_checkpoint(path, model=model)
    return (common, *read_slots(path, params, with_optimizer=with_optimizer))


def read_groups(params: Mapping[str, TensorSlot], *, with_optimizer: bool, budget: int) -> list[list[str]]:
    """``params`` in order, cut into groups whose host buffers (fp32 value, and both moments with
    ``with_optimizer``) stay within ``budget`` bytes; a tensor larger than that is a group alone (pure)."""
    per_element = 4 * (3 if with_optimizer else 1)
    groups: list[list[str]] = []
    filled = 0
    for name, slot in params.items():
        size = slot.tensor.numel() * per_element
        if not groups or filled + size > budget:
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += size
    return groups


def load_in_groups(path: str, *, params: Mapping[str, TensorSlot], with_optimizer: bool,
                   take: Callable[[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]], None],
                   budget: int | None = None) -> int:
    """Collective over the world. Read this rank's slots of the opened checkpoint ``path`` group by
    group (``read_groups``), handing each group's (values, moments) to ``take`` before the next is
    read, so host memory holds one group (``budget`` bytes; None: ``read_budget.READ_GROUP_BYTES``).
    Every rank joins as many reads as the rank with the most groups (an empty request when it has none
    left). Returns the number of reads."""
    from megatron_het.utils import read_budget

    budget = read_budget.READ_GROUP_BYTES if budget is None else budget
    groups = read_groups(params, with_optimizer=with_optimizer, budget=budget)
    count = torch.tensor([len(groups)], dtype=torch.int64, device=HOST_DEVICE)  # the world's host backend
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    count = int(count.item())
    for k in range(count):
        names = groups[k] if k < len(groups) else []
        values, moments = read_slots(path, {n: params[n] for n in names}, with_optimizer=with_optimizer)
        take(values, moments)
        del values, moments  # before the next group is read
    return count
