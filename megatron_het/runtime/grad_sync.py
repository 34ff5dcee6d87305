"""Gradient reduction across replicas of any layouts (and tied embeddings across stages).

Every parameter is a piece of a *full* tensor named by global layer index (see
``checkpoint/full_state.py``). The ranks that hold a piece of the same full tensor must all end an
iteration with the sum of every replica's gradient for the piece they hold. Two paths:

* direct: every holder has the same TP size, so the holders with the same TP rank hold the same
  slice; they all-reduce shard-sized buffers (Megatron's DP all-reduce);
* reshard: holders differ in TP size (e.g. replica 1 at TP=2 beside replica 2 at TP=4, or a tied
  word embedding at TP=1 on the first stage and TP=2 on the last); each holder writes its slice into a
  zero full-size buffer, the holders all-reduce it, and each reads its slice back. A replicated
  (non-partitioned) parameter is contributed once per stage (by TP rank 0) so it is not counted TP
  times (unless it is a sequence-parallel partial gradient, below).

With sequence parallelism, a replicated parameter used on sequence shards (norms, row-parallel
biases: megatron marks them ``sequence_parallel``) holds on each TP rank only its shard's part of
the gradient; megatron-core's ``finalize_model_grads`` sums them over the TP group. Here such a
parameter's bucket spans every holder of every stage, TP peers included, and every holder
contributes: one all-reduce gives the TP sum and the cross-replica sum together (also for a
parameter held by a single stage, which otherwise needs no reduction).

Which parameters go together in one buffer and which ranks reduce it is a pure function of what
every rank holds (``plan_buckets``), tested without processes; creating the groups is a thin
collective step (``GradientSynchronizer``). ``bucket_numel`` splits a group's parameters into
buckets of about that many elements in backward order, so an overlapped reduction
(``runtime/overlap_grad.py``) can start the first buckets while the backward still runs.

A direct bucket's gradients live in one contiguous buffer, each gradient a view of it, in bucket
order (megatron-core DDP's grad buffer): the bucket's all-reduce runs on that buffer in place, with no
packed copy (an overlapped reduction holds every launched bucket until ``reduce()``: packed copies
were one more fp32 copy of the rank's gradients). A reshard bucket packs its zero-padded full tensors.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_het.checkpoint.tp_layout import grid_contributes, grid_index, grid_kind, slice_full, write_local
from megatron_het.optim.norms import sum_of_squares_f64
from megatron_het.platform import HOST_DEVICE


@dataclass(frozen=True, kw_only=True)
class Holding:
    """One rank's piece of one full parameter."""

    name: str  # global name (checkpoint/full_state.py)
    rank: int
    stage_key: tuple[int, int]  # (replica, stage): ranks of one stage form one TP group
    tp_rank: int
    tp_size: int
    partition_dim: int | None  # None: replicated across the stage's TP ranks
    full_shape: tuple[int, ...]
    glu: bool = False  # gated-MLP fc1: the shard is [gate_r; up_r] (checkpoint/tp_layout.py)
    # replicated, but each TP rank's gradient covers only its sequence shard: every holder contributes
    sequence_parallel: bool = False
    # a 3D tensor-parallel stage (plan tp_grid): its (gx, gy, gz); ``tp_rank`` is then the rank's index
    # in the grid (x fastest) and ``tp_size`` gx*gy*gz. Parameters of the 3D layers hold
    # checkpoint/tp_layout.grid_index blocks; the rest (embedding, final norm, output layer) is
    # megatron-core at TP = gy (``partition_dim`` split over y) copied on every x and z rank.
    grid: tuple[int, int, int] | None = None


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """Parameters reduced together over one group of ranks."""

    ranks: tuple[int, ...]  # the group, sorted
    names: tuple[str, ...]  # parameters in buffer order
    direct: bool  # True: shard-sized all-reduce among same-TP-rank peers


def plan_buckets(holdings: Iterable[Holding], *, bucket_numel: int | None = None) -> list[Bucket]:
    """Group parameters by who holds them; deterministic order (every rank computes the same).

    A group's names run in reverse order of first appearance in ``holdings`` (each rank lists its
    parameters in forward order, so this is about the order the backward produces them).
    ``bucket_numel`` None: one bucket per group; otherwise a bucket closes once it holds
    ``bucket_numel`` full-tensor elements (a parameter is never split), as megatron-core's DDP does.
    """
    holdings = list(holdings)
    by_name: dict[str, list[Holding]] = {}
    first_seen: dict[str, int] = {}
    for i, h in enumerate(holdings):
        by_name.setdefault(h.name, []).append(h)
        first_seen.setdefault(h.name, i)
    groups: dict[tuple, list[str]] = {}
    for name in sorted(by_name, key=lambda n: -first_seen[n]):
        hs = by_name[name]
        if any(h.sequence_parallel for h in hs):
            partitioned = [h for h in hs if h.partition_dim is not None]
            if partitioned:
                raise ValueError(f"{name}: a sequence_parallel parameter must be replicated across TP ranks, but "
                                 f"rank {partitioned[0].rank} holds it split on dim {partitioned[0].partition_dim}. "
                                 f"Fix: do not mark tensor-parallel parameters sequence_parallel")
            ranks = tuple(sorted(h.rank for h in hs))
            if len(ranks) > 1:  # TP peers of one stage and every other holder: one sum
                groups.setdefault((ranks, False), []).append(name)
            continue
        if any(h.grid is not None for h in hs):  # 3D holders: always the full-size reshard path
            if _grid_bucket_needed(name, hs):
                groups.setdefault((tuple(sorted(h.rank for h in hs)), False), []).append(name)
            continue
        stages = {h.stage_key for h in hs}
        if len(stages) < 2:
            continue  # held by a single stage: nothing to reduce across replicas
        tp_sizes = {h.tp_size for h in hs}
        if len(tp_sizes) == 1:
            # Direct path: one group per TP rank.
            for tp_rank in sorted({h.tp_rank for h in hs}):
                ranks = tuple(sorted(h.rank for h in hs if h.tp_rank == tp_rank))
                groups.setdefault((ranks, True), []).append(name)
        else:
            ranks = tuple(sorted(h.rank for h in hs))
            groups.setdefault((ranks, False), []).append(name)
    numel = {name: int(torch.Size(hs[0].full_shape).numel()) for name, hs in by_name.items()}
    buckets = []
    for (ranks, direct), names in sorted(groups.items()):
        current, size = [], 0
        for name in names:
            current.append(name)
            size += numel[name]
            if bucket_numel is not None and size >= bucket_numel:
                buckets.append(Bucket(ranks=ranks, names=tuple(current), direct=direct))
                current, size = [], 0
        if current:
            buckets.append(Bucket(ranks=ranks, names=tuple(current), direct=direct))
    return buckets


def _grid_bucket_needed(name: str, hs: list[Holding]) -> bool:
    """A name with 3D holders needs a reduction when several stages hold it, or when a 3D stage with
    z > 1 holds a layer norm or bias (each z rank's gradient covers only its batch rows)."""
    if len({h.stage_key for h in hs}) > 1:
        return True
    return any(h.grid is not None and h.grid[2] > 1 and grid_kind(name) in ("norm", "bias") for h in hs)


def _grid_y(h: Holding) -> tuple[int, int]:
    """(y coordinate, gy) of a 3D holder: its rank and size in the TP = gy layout outside the layers."""
    gx, gy, _ = h.grid
    return (h.tp_rank // gx) % gy, gy


def contributes(h: Holding) -> bool:
    """Pure: whether ``h``'s gradient goes into a full-size sum over holders (the reshard path), so
    the sum counts every replica's gradient once: a partitioned shard always; a replicated parameter
    on TP rank 0 (every TP rank with sequence parallelism); on a 3D stage
    checkpoint/tp_layout.grid_contributes, and outside the 3D layers also y = 0 for a replicated one."""
    if h.grid is not None:
        if not grid_contributes(h.name, h.grid, h.tp_rank):
            return False
        return grid_kind(h.name) is not None or h.partition_dim is not None or _grid_y(h)[0] == 0
    return h.partition_dim is not None or h.tp_rank == 0 or h.sequence_parallel


def _owns(h: Holding) -> bool:
    """Within the owning stage: whether ``h``'s elements count in the norm (one copy of each)."""
    if h.grid is None:
        return h.partition_dim is not None or h.tp_rank == 0
    z = (h.tp_rank // (h.grid[0] * h.grid[1])) % h.grid[2]
    return contributes(h) and (grid_kind(h.name) not in ("norm", "bias") or z == 0)


def owned_norm_holdings(holdings: Iterable[Holding]) -> set[tuple[str, int]]:
    """(name, rank) pairs whose elements count once in the global gradient norm.

    After reduction every holder has the same values, so each full element is counted on one stage
    only: the stage with the smallest key; within it every TP rank for a partitioned parameter,
    TP rank 0 for a replicated one.
    """
    by_name = _by_name(holdings)
    return {(name, h.rank) for name, hs in by_name.items() for h in hs
            if h.stage_key == min(x.stage_key for x in hs) and _owns(h)}


def checkpoint_writers(holdings: Iterable[Holding]) -> set[tuple[str, int]]:
    """(name, rank) pairs that write each parameter (and its optimizer moments) into a checkpoint:
    one stage per parameter, within it the ranks ``owned_norm_holdings`` would take, but the stage is
    chosen to even out the elements each rank writes (largest parameters first, each to the holding
    stage whose ranks then write the least; ties to the smaller stage key), not always the first
    replica: a save then builds on each rank only its share of the full-precision values, and the
    writing is spread over the replicas as Megatron's fully parallel save spreads it."""
    by_name = _by_name(holdings)
    load: dict[tuple[int, int], int] = {}  # stage key -> elements each of its writing ranks writes

    def share(h: Holding) -> int:
        numel = math.prod(h.full_shape)
        return numel // h.tp_size if h.partition_dim is not None or h.grid is not None else numel

    writers = set()
    for name in sorted(by_name, key=lambda n: (-math.prod(by_name[n][0].full_shape), n)):
        stages: dict[tuple[int, int], list[Holding]] = {}
        for h in by_name[name]:
            stages.setdefault(h.stage_key, []).append(h)
        key = min(stages, key=lambda k: (load.get(k, 0) + share(stages[k][0]), k))
        load[key] = load.get(key, 0) + share(stages[key][0])
        writers.update((name, h.rank) for h in stages[key] if _owns(h))
    return writers


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _by_name(holdings: Iterable[Holding]) -> dict[str, list[Holding]]:
    by_name: dict[str, list[Holding]] = {}
    for h in holdings:
        by_name.setdefault(h.name, []).append(h)
    return by_name


def _slice(full: torch.Tensor, h: Holding) -> torch.Tensor:
    if h.grid is not None:
        return _grid_slice(full, h)
    if h.partition_dim is None:
        return full
    return slice_full(full, h.partition_dim, h.tp_rank, h.tp_size, h.glu)


def _grid_slice(full: torch.Tensor, h: Holding) -> torch.Tensor:
    index = grid_index(h.name, tuple(full.shape), h.grid, h.tp_rank, h.glu)
    if index is not None:
        return full[index]
    if h.partition_dim is None:
        return full
    y, gy = _grid_y(h)
    return slice_full(full, h.partition_dim, y, gy, h.glu)


def held_indices(h: Holding) -> list[torch.Tensor]:
    """Per dim of the full tensor, the full indices ``h`` holds, in its local order (its piece is
    the product of these sets: a slice, a gated pair of slices, a 3D block). Pure: the holder's
    view (``grad_sync._slice``, the one definition of where a piece sits) of an index tensor."""
    out = []
    for d, n in enumerate(h.full_shape):
        shape = [1] * len(h.full_shape)
        shape[d] = n
        view = _slice(torch.arange(n, device=HOST_DEVICE).view(shape).expand(h.full_shape), h)
        out.append(view[tuple(slice(None) if i == d else 0 for i in range(view.dim()))].reshape(-1))
    return out


def _write(full: torch.Tensor, local: torch.Tensor, h: Holding) -> None:
    if h.grid is not None:
        if grid_index(h.name, tuple(full.shape), h.grid, h.tp_rank, h.glu) is None and h.partition_dim is not None:
            y, gy = _grid_y(h)
            write_local(full, local, h.partition_dim, y, gy, h.glu)  # slice_full copies a gated pair
        else:
            _grid_slice(full, h).copy_(local)
        return
    if h.partition_dim is None:
        full.copy_(local)
    else:
        write_local(full, local, h.partition_dim, h.tp_rank, h.tp_size, h.glu)


class GradientSynchronizer:
    """Creates the reduction groups once (collective over the world) and reduces each step."""

    def __init__(self, local: Sequence[Holding], params: Mapping[str, torch.nn.Parameter], *,
                 placement=None, bucket_numel: int | None = None, timeout: datetime.timedelta | None = None,
                 accelerator=None, grads: Mapping[str, torch.Tensor] | None = None, groups=None) -> None:
        """``placement`` (comm_routing.RankPlacement) routes groups that span collective libraries
        through the cross-vendor bridge; None: every group is a plain torch group.
        ``accelerator`` (platform.Accelerator; None: detected) places the buffers and picks backends.
        ``bucket_numel``: see ``plan_buckets`` (None: one bucket per group of holders).
        ``timeout``: the run's group timeout (TrainConfig.group_timeout).
        ``grads``: the gradients reduced, by name, where they are not the parameters' ``.grad`` (the
        distributed optimizer's fp32 main gradients in mixed precision, ``MainGrads.grads``).
        ``groups`` (comm_routing.ReductionGroups) shares one group per rank set with the run's other
        users (None: a cache of this synchronizer's own from ``placement``, ``accelerator``, ``timeout``)."""
        from megatron_het.platform import detect_accelerator
        from megatron_het.runtime.comm_routing import ReductionGroups

        self.accelerator = accelerator or detect_accelerator()
        self.device = self.accelerator.device

        gathered: list[list[Holding] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, list(local))
        self.all_holdings = [h for hs in gathered for h in hs]
        self.buckets = plan_buckets(self.all_holdings, bucket_numel=bucket_numel)
        self.rank = dist.get_rank()
        self.params = dict(params)
        self._grads = dict(grads) if grads is not None else None
        self.local = {h.name: h for h in local}
        self._groups = []
        self.routes: list[tuple[tuple[int, ...], str]] = []  # (ranks, "native" | "het-bridge"), for the log
        if groups is None:
            groups = ReductionGroups(placement, accelerator=self.accelerator, timeout=timeout)
        for bucket in self.buckets:  # every rank asks for every bucket's group, in the same order
            group = groups(bucket.ranks)
            if group is not None:
                self._groups.append((bucket, group))
                self.routes.append((bucket.ranks, group.kind))
        # (name, rank) pairs that count each full element once in the gradient and parameter norms
        # (a checkpoint's writers are spread over the holders instead: checkpoint_writers)
        self.owned = owned_norm_holdings(self.all_holdings)
        self.norm_names = [n for n in self.local if (n, self.rank) in self.owned]
        self._flat: dict[int, torch.Tensor] = {}  # id(bucket) -> the buffer its gradients are views of
        self._contiguous_grads()

    def _contiguous_grads(self) -> None:
        """One buffer per direct bucket, its gradients moved into it (``_adopt``)."""
        for bucket, _ in self._groups:
            if not bucket.direct:
                continue
            grads = [self._grad(n) for n in bucket.names]
            if len({g.dtype for g in grads}) != 1:
                continue  # one buffer holds one dtype
            flat = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=self.device)
            self._adopt(bucket, flat)
            self._flat[id(bucket)] = flat

    @torch.no_grad()
    def _adopt(self, bucket: Bucket, flat: torch.Tensor) -> None:
        """Make every gradient of ``bucket`` a view of its slice of ``flat``, in bucket order: one not
        there yet (at construction, or a ``.grad`` something assigned anew since) is copied in and
        re-pointed with ``set_``, so every holder of the tensor object (the main-gradient hooks, the
        optimizer) sees the buffer."""
        storage, at = flat.untyped_storage(), 0
        for name in bucket.names:
            g = self._grad(name)
            if g.untyped_storage().data_ptr() != storage.data_ptr() or g.storage_offset() != at:
                flat[at:at + g.numel()].copy_(g.reshape(-1))
                g.set_(storage, at, g.shape, _contiguous_strides(g.shape))
            at += g.numel()

    def reduce(self) -> None:
        """Sum every parameter's gradient over all its holders (grads must exist)."""
        for bucket, group in self._groups:
            flat = self._pack(bucket)
            group.all_reduce(flat)
            self._unpack(bucket, flat)

    def _pack(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's gradients as one flat buffer: the buffer they live in (direct), or a copy of
        the shards, or zero-padded full tensors."""
        flat = self._flat.get(id(bucket))
        if flat is not None:
            self._adopt(bucket, flat)  # normally a no-op: the gradients are views of it
            return flat
        grads = [self._grad(n) for n in bucket.names]
        if bucket.direct:
            return torch.cat([g.reshape(-1) for g in grads])
        pieces = []
        for name, g in zip(bucket.names, grads):
            h = self.local[name]
            full = torch.zeros(h.full_shape, dtype=g.dtype, device=self.device)
            if contributes(h):
                _write(full, g, h)
            pieces.append(full.reshape(-1))
        return torch.cat(pieces)

    def _unpack(self, bucket: Bucket, flat: torch.Tensor) -> None:
        """Copy each parameter's part of the reduced buffer back into its gradient (nothing to copy
        where the gradients are views of it)."""
        if flat is self._flat.get(id(bucket)):
            return
        offset = 0
        for name in bucket.names:
            g, h = self._grad(name), self.local[name]
            if bucket.direct:
                n = g.numel()
                g.copy_(flat[offset:offset + n].view_as(g))
            else:
                n = int(torch.Size(h.full_shape).numel())
                g.copy_(_slice(flat[offset:offset + n].view(h.full_shape), h))
            offset += n

    def scale_grads(self, coeff: float | torch.Tensor) -> None:
        """Clipping: scale every gradient the optimizer will read."""
        for name in self.local:
            self._grad(name).mul_(coeff)

    def grad_norm_sq_local(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (sum it over the world)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for name in self.norm_names:
            total += sum_of_squares_f64(self._grad(name))
        return total

    def param_norm_sq_local(self) -> torch.Tensor:
        """This rank's share of the squared global parameter norm (--log-params-norm)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for name in self.norm_names:
            total += sum_of_squares_f64(self.params[name].detach())
        return total

    def grad_zeros_local(self) -> torch.Tensor:
        """This rank's share of the global count of zero gradient elements (--log-num-zeros-in-grad)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for name in self.norm_names:
            total += (self._grad(name) == 0).sum()
        return total

    def _grad(self, name: str) -> torch.Tensor:
        if self._grads is not None:
            return self._grads[name]
        p = self.params[name]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad
