"""Process groups for one homogeneous block of ranks, as megatron-core's ProcessGroupCollection.

A block is a contiguous rank range laid out like Megatron (TP fastest, then DP, then PP) and
described by ``HyperCommGrid(shape, dim_names, rank_offset)``. Nothing here touches megatron's
global ``parallel_state`` except the attention memory buffer, which megatron-core 0.19.2's
``DotProductAttention`` still fetches globally (see ``ensure_global_memory_buffer``).

``torch.distributed.new_group`` is collective over the whole world: every rank must build every
block's groups in the same order, including blocks it is not part of.

Timeouts: a new group does not inherit the world group's timeout (torch gives it its own 30-minute
default), so every builder here takes the run's one ``timeout`` (Megatron's
``--distributed-timeout-minutes``) and passes it to every group it creates.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

import megatron_het.platform  # noqa: F401  (triton import guard)

# HyperCommGrid dim order: the first name varies fastest (Megatron's "tp-cp-ep-dp-pp").
GRID_DIMS = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True, kw_only=True)
class BlockShape:
    """A Megatron-style homogeneous block of tp * dp * pp ranks starting at rank_offset."""

    tp: int  # tensor-parallel size
    pp: int  # pipeline stages
    dp: int  # data-parallel replicas
    rank_offset: int = 0  # first global rank of the block

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"BlockShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.rank_offset < 0:
            raise ValueError(f"BlockShape.rank_offset must be >= 0, got {self.rank_offset}")

    @property
    def size(self) -> int:
        return self.tp * self.pp * self.dp

    def ranks(self) -> range:
        return range(self.rank_offset, self.rank_offset + self.size)


def ensure_global_memory_buffer() -> None:
    """megatron-core 0.19.2 ``transformer/dot_product_attention.py`` calls
    ``parallel_state.get_global_memory_buffer()``; it is the one global a stage model still needs."""
    from megatron.core import parallel_state

    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()


def group_options(timeout: datetime.timedelta | None, backend: str | None = None, device_id=None) -> dict:
    """Keyword arguments for ``new_group``: the run's timeout, when given (None keeps torch's default
    of 30 minutes, whatever the world group's timeout is), and the accelerator's backend for the
    group's island (``Accelerator.backend_for``; None: the world's default), and ``device_id``: a GPU
    group's eager creation (``Accelerator.eager_device``; None: created at its first collective)."""
    out = {} if backend is None else {"backend": backend}
    if device_id is not None:
        out["device_id"] = device_id
    if timeout is None:
        return out
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout: must be a positive datetime.timedelta (got {timeout!r}). "
                         "Fix: pass datetime.timedelta(minutes=args.distributed_timeout_minutes)")
    return {**out, "timeout": timeout}


def block_process_groups(shape: BlockShape, *, timeout: datetime.timedelta | None = None,
                         backend: str | None = None):
    """Create the groups of one block; returns ``(grid, pg_collection)`` (collection is None on
    ranks outside the block). Must be called by every rank of the world, in the same order.
    ``timeout`` applies to every group created (see the module docstring); ``backend`` is the
    accelerator's backend for the block's island (None: the world's default)."""
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    options = group_options(timeout)  # the grid passes its backend itself
    grid = HyperCommGrid([shape.tp, 1, 1, shape.dp, shape.pp], list(GRID_DIMS),
                         rank_offset=shape.rank_offset, backend=backend)
    pgs = {
        "tp": grid.create_pg("tp", **options),
        "pp": grid.create_pg("pp", **options),
        "dp": grid.create_pg("dp", **options),
        "cp": grid.create_pg("cp", **options),
        "ep": grid.create_pg("ep", **options),
        "mp": grid.create_pg(["tp", "pp"], **options),
        "tp_cp": grid.create_pg(["tp", "cp"], **options),
        "dp_cp": grid.create_pg(["cp", "dp"], **options),
        "tp_dp_cp": grid.create_pg(["tp", "cp", "dp"], **options),
    }
    # Word embeddings live on the first and last stage of each pipeline, position embeddings on
    # the first (megatron-core parallel_state.default_embedding_ranks / default_position_embedding_ranks).
    rank = dist.get_rank()
    embd = pos_embd = None
    for pp_ranks in grid.get_rank_enum("pp"):
        embd_ranks = sorted({pp_ranks[0], pp_ranks[-1]})
        g = dist.new_group(embd_ranks, **options, backend=backend)
        if rank in embd_ranks:
            embd = g
        g = dist.new_group([pp_ranks[0]], **options, backend=backend)
        if rank == pp_ranks[0]:
            pos_embd = g
    if rank not in shape.ranks():
        return grid, None
    pgc = ProcessGroupCollection(**pgs)
    pgc.embd = embd
    pgc.pos_embd = pos_embd
    # Dense models: expert groups are the dense ones (no expert parallelism).
    pgc.expt_dp = pgs["dp"]
    pgc.expt_tp = pgs["tp"]
    pgc.tp_ep = pgs["tp"]
    pgc.tp_ep_pp = pgs["mp"]
    ensure_global_memory_buffer()
    return grid, pgc
