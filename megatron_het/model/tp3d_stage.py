"""A pipeline stage whose transformer layers are 3D tensor-parallel (AxoNN's layout, #20 item 3).

The stage is megatron-core's ``GPTModel`` at tensor-parallel size ``gy`` (its TP group is the grid's
y group) with a block of 3D layers (``model/tp3d.grid_layer_spec``). Inside the layers hidden states
are ``[s, b/gz, h/gx]`` blocks replicated over y; outside them everything is full ``[s, b, h]``: the
first layer's input is sliced to the rank's block (backward: the block gradients all-gathered over x
and z) and the last layer's output gathered back (backward: sliced). So the embedding, final norm,
output layer and loss are megatron-core's own at TP = gy, computed identically on every x and z
rank, and a 3D stage looks to the pipeline boundaries like a 1D stage without sequence parallelism
(every rank sends and receives the whole activation). The cost beyond the 3D layers is one slice and
one gather at each end of the stage.

Gradients after a backward: the linear weights' blocks are complete (reduce-scattered over z); the
norms' and biases' blocks hold only the rank's batch rows' part (sum them over z:
``model/tp3d.sum_replicated_grads_over_z``, or over holders with ``checkpoint/tp_layout.grid_contributes``);
the embedding, final norm and output layer hold megatron-core's TP = gy gradients, equal on every x
and z rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_het.tp.groups import GridGroups

__all__ = ["attach_grid_ends", "build_tp3d_gpt_stage", "check_tp3d_stage", "from_grid_block", "to_grid_block"]


def _block(n: int, parts: int, i: int) -> slice:
    return slice(i * n // parts, (i + 1) * n // parts)


def _slice_block(t: torch.Tensor, groups: GridGroups) -> torch.Tensor:
    g, c = groups.grid, groups.coords
    return t[:, _block(t.shape[1], g.z, c["z"]), _block(t.shape[2], g.x, c["x"])].contiguous()


def _gather(t: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    n = dist.get_world_size(group=group)
    if n == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _gather_block(t: torch.Tensor, groups: GridGroups) -> torch.Tensor:
    """``[s, b/gz, h/gx]`` blocks of the x and z groups -> ``[s, b, h]`` (group order = coordinate order)."""
    return _gather(_gather(t, groups.x, 2), groups.z, 1)


class _ToBlock(torch.autograd.Function):
    """Full ``[s, b, h]`` (equal on every rank) -> this rank's block; backward gathers the blocks'
    gradients (each equal over y), so every rank gets the whole input gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, groups: GridGroups) -> torch.Tensor:
        ctx.groups = groups
        return _slice_block(x, groups)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _gather_block(g.contiguous(), ctx.groups), None


class _FromBlock(torch.autograd.Function):
    """This rank's block -> full ``[s, b, h]``; backward slices the (equal on every rank) gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, groups: GridGroups) -> torch.Tensor:
        ctx.groups = groups
        return _gather_block(x, groups)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _slice_block(g, ctx.groups), None


def to_grid_block(x: torch.Tensor, groups: GridGroups) -> torch.Tensor:
    return _ToBlock.apply(x, groups)


def from_grid_block(x: torch.Tensor, groups: GridGroups) -> torch.Tensor:
    return _FromBlock.apply(x, groups)


def attach_grid_ends(gpt: torch.nn.Module, groups: GridGroups) -> list[Any]:
    """Hooks on the stage's first and last transformer layer: slice the first one's input to the
    rank's block, gather the last one's output back (parameter names stay megatron-core's). Returns
    the hook handles."""
    layers = gpt.decoder.layers
    if len(layers) == 0:
        raise ValueError("num_layers: a 3D stage needs at least 1 transformer layer, got 0 (limit 1). "
                         "Fix: give the stage layers, or drop its tp_grid")

    def pre(_module, args, kwargs):
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": to_grid_block(kwargs["hidden_states"], groups)}
        else:
            args = (to_grid_block(args[0], groups), *args[1:])
        return args, kwargs

    def post(_module, _args, output):
        if isinstance(output, tuple):
            return (from_grid_block(output[0], groups), *output[1:])
        return from_grid_block(output, groups)

    return [layers[0].register_forward_pre_hook(pre, with_kwargs=True), layers[-1].register_forward_hook(post)]


def check_tp3d_stage(*, grid: tuple[int, int, int], hidden_size: int, micro_batch_size: int, gated: bool,
                     sequence_parallel: bool) -> None:
    """What a 3D stage cannot run yet, refused by value (ValueError naming both numbers)."""
    gx, gy, gz = grid
    if gated:
        raise ValueError("swiglu: a gated MLP (SwiGLU) has no 3D layer yet (got swiglu=True). "
                         "Fix: use 1D tensor parallelism (no tp_grid) for gated models")
    if sequence_parallel:
        raise ValueError("sequence_parallel: a 3D stage splits the batch over z, not the sequence (got True). "
                         "Fix: build the 3D stage's config with sequence_parallel=False (HeteroTrainer does: the plan's flag "
                         "applies to its 1D stages)")
    if hidden_size % gx:
        raise ValueError(f"hidden_size: {hidden_size} must be a multiple of the grid's x = {gx}. "
                         f"Fix: choose a grid whose x divides {hidden_size}")
    if micro_batch_size % gz:
        raise ValueError(f"micro_batch_size: {micro_batch_size} must be a multiple of the grid's z = {gz} "
                         f"(z splits the batch). Fix: a micro-batch size divisible by {gz}, or z = 1")
    del gy


def build_tp3d_gpt_stage(spec, config, pg_collection, grid_groups: GridGroups, *, micro_batch_size: int,
                         device=None, chunks: int = 4, overlap: bool = True):
    """The stage's GPTModel of 3D layers. ``spec``: model/gpt.StageModelSpec; ``config``: its
    TransformerConfig with ``tensor_model_parallel_size`` = the grid's y; ``pg_collection``: TP group =
    ``grid_groups.y``."""
    from megatron.core.models.gpt import GPTModel

    from megatron_het.model.tp3d import grid_layer_spec

    g = grid_groups.grid
    if config.tensor_model_parallel_size != g.y:
        raise ValueError(f"tensor_model_parallel_size: a 3D stage runs megatron-core at TP = y = {g.y}, the "
                         f"config has {config.tensor_model_parallel_size}. Fix: build the config with tp={g.y}")
    m = spec.model
    check_tp3d_stage(grid=(g.x, g.y, g.z), hidden_size=m.hidden_size, micro_batch_size=micro_batch_size,
                     gated=m.swiglu, sequence_parallel=config.sequence_parallel)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=grid_layer_spec(grid_groups, chunks=chunks, overlap=overlap),
        vocab_size=spec.vocab_size,
        max_sequence_length=m.max_position_embeddings or m.seq_length,
        pre_process=spec.pre_process,
        post_process=spec.post_process,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type="learned_absolute",
        pg_collection=pg_collection,
    )
    gpt.grid_hooks = attach_grid_ends(gpt, grid_groups)
    return gpt if device is None else gpt.to(device)
