"""All-gather and reduce-scatter of *uneven* contiguous shards over any torch.distributed backend.

NCCL has uneven variants of both (torch runs them as coalesced groups of broadcasts / reduces); gloo
has no uneven all-gather and its reduce-scatter is an all-reduce underneath, so portable
constructions are offered:

- all-gather ``"padded"`` (default): every rank pads its shard to the largest one and one
  ``all_gather`` moves ``world x max_size`` elements; the padding is cut off afterwards. One
  collective; costs what a ring over the largest shard costs (the perf model assumes this).
  ``"broadcast"``: each owner broadcasts its exact shard in turn (no padding, ``world`` calls).
  ``"all_reduce"``: every rank writes its shard into a zero buffer and the buffers are summed (exact:
  adding zeros rounds nothing); twice a ring all-gather's traffic, but one all-reduce.
- reduce-scatter ``"native"`` (default): one reduce-scatter collective of the backend. Equal slices
  are one ``reduce_scatter_tensor`` on the buffer itself; uneven ones the list form
  ``dist.reduce_scatter``, which NCCL and RCCL run as one coalesced group of reduces (one launch,
  exact bytes, no padding). The traffic of a ring reduce-scatter, as the perf model prices it.
  On host tensors (gloo) it runs ``"reduce"``: gloo's reduce-scatter (torch 2.13, both forms)
  all-reduces underneath, twice those bytes (profiled; perf/axonn.py prices its
  ``_reduce_scatter_base`` so).
  ``"reduce"``: the
  slice owned by rank ``r`` is summed onto ``r`` with one ``dist.reduce`` per owner (the same
  traffic, but ``world`` separate collectives: hundreds of launches per bucket on a large group).
  ``"all_reduce"``: all-reduce the full buffer and keep the slice (simplest, twice the traffic).

``layout`` (``optim.layout.ShardLayout``: ``sizes``, ``world``, ``numel``, ``max_size``, ``range``) is indexed by rank *in the group* (ascending global rank); every rank must call with
the same layout.

``bridge``: a ``comm.HetGroup`` (any subset of the world), for groups whose ranks span collective
libraries (NVIDIA beside AMD): the padded all-gather and a padded reduce-scatter then run through
the bridge (native inside each island, host-staged between them, through one leader per island)
instead of one torch group; with ``method="all_reduce"`` both run as the bridge's sharded
all-reduce instead (each island's ranks then share the crossing, see docs/communicator.md).

These are the project's one home for uneven collectives: the sharded strategy (Cephalo mode) and the pipeline runtime's distributed optimizer
(``megatron_het/optim/``) both call them; ``sharding/collectives.py`` re-exports them.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from megatron_het.platform import HOST_DEVICE

__all__ = ["uneven_all_gather", "uneven_all_gather_start", "uneven_reduce_scatter", "GATHER_METHODS",
           "REDUCE_SCATTER_METHODS", "PendingGather"]

GATHER_METHODS = ("padded", "broadcast", "all_reduce")
REDUCE_SCATTER_METHODS = ("native", "reduce", "all_reduce")


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _check(layout, group: dist.ProcessGroup | None, bridge=None) -> int:
    if bridge is not None:
        members = sorted(bridge.topology.ranks)
        world, me = len(members), members.index(dist.get_rank())
    else:
        world, me = dist.get_world_size(group), dist.get_rank(group)
    if layout.world != world:
        raise ValueError(f"layout: has {layout.world} shards but the group has {world} ranks. "
                         "Fix: build the layout with one fraction per rank of the group")
    return me


def _bridge_order(bridge) -> list[int]:
    """Index in the bridge's tensor lists of each group rank (ascending global rank)."""
    ranks = list(bridge.topology.ranks)
    return [ranks.index(r) for r in sorted(ranks)]


def uneven_all_gather(shard: torch.Tensor, layout, *, group: dist.ProcessGroup | None = None,
                      method: Literal["padded", "broadcast", "all_reduce"] = "padded", bridge=None) -> torch.Tensor:
    """Concatenate every rank's 1-D ``shard`` (rank ``r`` passes ``layout.sizes[r]`` elements)."""
    me = _check(layout, group, bridge)
    if shard.dim() != 1 or shard.numel() != layout.sizes[me]:
        raise ValueError(f"shard: rank {me} must pass a 1-D tensor of {layout.sizes[me]} elements "
                         f"(got shape {tuple(shard.shape)}). Fix: pass this rank's flat shard")
    if method == "all_reduce":
        full = shard.new_zeros(layout.numel)
        start, stop = layout.range(me)
        full[start:stop] = shard
        if bridge is not None:
            bridge.all_reduce(full)
        else:
            dist.all_reduce(full, group=group)
        return full
    if bridge is not None:
        padded = shard.new_zeros(layout.max_size)
        padded[:shard.numel()] = shard
        bufs = [torch.empty_like(padded) for _ in range(layout.world)]
        bridge.all_gather(bufs, padded)
        at = _bridge_order(bridge)
        return torch.cat([bufs[at[r]][:n] for r, n in enumerate(layout.sizes)])
    if method == "padded":
        padded = shard.new_zeros(layout.max_size)  # buffers follow the shard's device
        padded[:shard.numel()] = shard
        bufs = [torch.empty_like(padded) for _ in range(layout.world)]
        dist.all_gather(bufs, padded, group=group)
        return torch.cat([b[:n] for b, n in zip(bufs, layout.sizes)])
    if method == "broadcast":
        full = shard.new_empty(layout.numel)
        for r in range(layout.world):
            start, stop = layout.range(r)
            if stop == start:
                continue
            piece = shard.clone() if r == me else shard.new_empty(stop - start)
            dist.broadcast(piece, src=_global(group, r), group=group)
            full[start:stop] = piece
        return full
    raise ValueError(f"method: unknown all-gather method {method!r}. Fix: use one of {GATHER_METHODS}")


def uneven_reduce_scatter(full: torch.Tensor, layout, *, group: dist.ProcessGroup | None = None,
                          method: Literal["native", "reduce", "all_reduce"] = "native", bridge=None) -> torch.Tensor:
    """Sum of every rank's 1-D ``full`` over this rank's range (``full`` is left unchanged)."""
    me = _check(layout, group, bridge)
    if full.dim() != 1 or full.numel() != layout.numel:
        raise ValueError(f"full: must be a 1-D tensor of {layout.numel} elements (got shape {tuple(full.shape)}). "
                         "Fix: pass the flat buffer the layout was built for")
    start, stop = layout.range(me)
    if bridge is not None and method == "all_reduce":
        total = full.clone()
        bridge.all_reduce(total)
        return total[start:stop].clone()
    if bridge is not None:  # pieces padded to the largest shard, in the bridge's rank order
        pieces = [full.new_zeros(layout.max_size) for _ in range(layout.world)]
        for r, at in enumerate(_bridge_order(bridge)):
            lo, hi = layout.range(r)
            pieces[at][:hi - lo] = full[lo:hi]
        out = full.new_empty(layout.max_size)
        bridge.reduce_scatter(out, pieces)
        return out[:stop - start].clone()
    if method == "native" and full.device.type == HOST_DEVICE.type:
        # host tensors go through the host backend (gloo, also in a "cpu:gloo,cuda:nccl" group), whose
        # reduce-scatter all-reduces underneath (twice the bytes): per-owner reduces instead
        method = "reduce"
    if method == "native":
        mine = full.new_empty(stop - start)
        if len(set(layout.sizes)) == 1:  # equal slices: the buffer itself is the collective's input
            dist.reduce_scatter_tensor(mine, full, op=dist.ReduceOp.SUM, group=group)
        else:  # views of ``full``: NCCL's uneven form reduces from them without writing (output is only the root's)
            dist.reduce_scatter(mine, list(full.split(list(layout.sizes))), op=dist.ReduceOp.SUM, group=group)
        return mine
    if method == "reduce":
        mine = None
        for r in range(layout.world):
            lo, hi = layout.range(r)
            if hi == lo:
                continue
            piece = full[lo:hi].clone()
            dist.reduce(piece, dst=_global(group, r), op=dist.ReduceOp.SUM, group=group)
            if r == me:
                mine = piece
        return mine if mine is not None else full.new_empty(0)
    if method == "all_reduce":
        total = full.clone()
        dist.all_reduce(total, group=group)
        return total[start:stop].clone()
    raise ValueError(f"method: unknown reduce-scatter method {method!r}. Fix: use one of {REDUCE_SCATTER_METHODS}")


class PendingGather:
    """An uneven all-gather in flight (``uneven_all_gather_start``); ``wait()`` returns the full vector."""

    def __init__(self, *, work, bufs: list[torch.Tensor] | None, sizes: tuple[int, ...],
                 done: torch.Tensor | None = None) -> None:
        self._work, self._bufs, self._sizes, self._done = work, bufs, sizes, done

    def wait(self) -> torch.Tensor:
        if self._done is None:
            if self._work is not None:
                self._work.wait()
            self._done = torch.cat([b[:n] for b, n in zip(self._bufs, self._sizes)])
            self._bufs = self._work = None
        return self._done


def uneven_all_gather_start(shard: torch.Tensor, layout, *, group: dist.ProcessGroup | None = None,
                            bridge=None, bridge_method: Literal["padded", "all_reduce"] = "padded") -> PendingGather:
    """``uneven_all_gather`` (padded) started asynchronously on a torch group; a bridged group has
    no async form here, so it completes before returning (still correct, nothing overlapped);
    ``bridge_method``: the bridge's construction (``uneven_all_gather``'s ``method``)."""
    if bridge is not None:
        return PendingGather(work=None, bufs=None, sizes=layout.sizes,
                             done=uneven_all_gather(shard, layout, bridge=bridge, method=bridge_method))
    me = _check(layout, group)
    if shard.dim() != 1 or shard.numel() != layout.sizes[me]:
        raise ValueError(f"shard: rank {me} must pass a 1-D tensor of {layout.sizes[me]} elements "
                         f"(got shape {tuple(shard.shape)}). Fix: pass this rank's flat shard")
    padded = shard.new_zeros(layout.max_size)
    padded[:shard.numel()] = shard
    bufs = [torch.empty_like(padded) for _ in range(layout.world)]
    work = dist.all_gather(bufs, padded, group=group, async_op=True)
    return PendingGather(work=work, bufs=bufs, sizes=layout.sizes)
