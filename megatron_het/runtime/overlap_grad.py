"""Opt-in overlap of the cross-replica gradient reduction with the backward pass.

``runtime/grad_sync.GradientSynchronizer.reduce()`` runs after the whole backward: every bucket's
all-reduce is exposed. megatron-core's DDP (``overlap_grad_reduce=True``) instead launches each
bucket's reduction (all-reduce, or reduce-scatter with the distributed optimizer) from a hook as
soon as the last gradient of the bucket has been accumulated during the *last* micro-batch's
backward, and waits for all of them in ``finish_grad_sync``; ``overlap_param_gather=True`` (with the
distributed optimizer) likewise all-gathers the updated parameter shards bucket by bucket in the
next forward, just before each bucket's first layer needs them.

``OverlappedGradientSynchronizer`` does the former for the heterogeneous runtime's buckets (same
buckets, same groups, same packing as the parent, so the result is the same sum)::

    sync = OverlappedGradientSynchronizer(local_holdings, params)   # instead of GradientSynchronizer
    for i, mb in enumerate(microbatches):
        if i == len(microbatches) - 1:
            sync.arm()          # this backward launches each bucket's all-reduce when it is ready
        loss(mb).backward()
    sync.reduce()               # waits; launches any bucket that did not fire; copies results back

Without ``arm()`` it behaves exactly like the parent (everything in ``reduce()``). In bf16/fp16 it
reduces the fp32 main gradients (``hook_params``: the model's half-precision parameters). Buckets routed
through the cross-vendor bridge (``placement=``) have no async form: they wait for ``reduce()``
(all ranks reduce them there in bucket order). Reducing them inside the hook would block a rank's
backward before it sends its input gradient upstream, while a peer of the bucket waits for that
gradient: a deadlock across stages (seen on the bridged bf16 parity plan). Buckets over the same
ranks share one process group (``comm_routing.ReductionGroups``), and a group's collectives must be
issued in one order on every member, so a group's buckets launch strictly in bucket order (a ready
bucket waits for the earlier ones of its group). Parameters that got no gradient in the armed backward
keep their bucket from firing; ``reduce()`` then launches it (zeros filled in, as the parent does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_het.runtime.grad_sync import GradientSynchronizer, Holding

__all__ = ["OverlappedGradientSynchronizer"]


def _is_async(group: Any) -> bool:
    """A torch group (raw or the parent's ``NativeGroup``): its all-reduce can start without blocking."""
    return isinstance(group, dist.ProcessGroup) or getattr(group, "kind", None) == "native"


def _start_all_reduce(group: Any, flat: torch.Tensor) -> Any:
    """Async all-reduce on a torch group (raw or the parent's ``NativeGroup`` wrapper); a bridged
    cross-vendor group has no async form, so it reduces now (blocking: only from ``reduce()``)."""
    if isinstance(group, dist.ProcessGroup):
        return dist.all_reduce(flat, group=group, async_op=True)
    if getattr(group, "kind", None) == "native":
        return dist.all_reduce(flat, group=group.group, async_op=True)
    group.all_reduce(flat)
    return None


class OverlappedGradientSynchronizer(GradientSynchronizer):
    """``GradientSynchronizer`` whose bucket all-reduces start from gradient hooks when armed."""

    def __init__(self, local: Sequence[Holding], params: Mapping[str, torch.nn.Parameter], *,
                 hook_params: Mapping[str, torch.nn.Parameter] | None = None,
                 chunk_of: Mapping[str, int] | None = None, **kwargs: Any) -> None:
        """``params``: what is reduced (their ``.grad``); ``hook_params``: the parameters autograd
        accumulates into, whose hooks tell that a gradient is final (None: ``params``). Mixed precision
        reduces the fp32 main gradients (``params`` = main parameters) as the half-precision model
        parameters' hooks fire, after ``MainParams``' own hook (registered first) has added the
        half-precision gradient into the main gradient, as Megatron's DDP reduces its fp32 main_grad
        buckets. ``chunk_of``: each parameter's model chunk (interleaved schedules; None: one chunk),
        so ``arm(c)`` counts only chunk c's gradients as final. ``kwargs`` go to
        ``GradientSynchronizer`` unchanged (e.g. ``placement``)."""
        super().__init__(local, params, **kwargs)
        hook_params = self.params if hook_params is None else hook_params
        self._armed = False
        self._chunk_of = dict(chunk_of) if chunk_of is not None else None
        self._armed_chunks: set[int | None] = set()  # chunks whose last backward has begun (None: all)
        self._pending: dict[int, set[str]] = {}  # bucket index -> names whose grad is not final yet
        self._inflight: dict[int, tuple[torch.Tensor, Any]] = {}  # bucket index -> (flat buffer, work)
        self.launched_in_backward = 0  # buckets launched from hooks in the last armed backward
        self._bucket_of: dict[str, list[int]] = {}
        for i, (bucket, _) in enumerate(self._groups):
            for name in bucket.names:
                self._bucket_of.setdefault(name, []).append(i)
        # Buckets over the same ranks share one group (comm_routing.ReductionGroups), and collectives
        # on a group must be issued in the same order on every member. Hooks complete buckets in each
        # rank's own backward order (replicas of different layouts differ), so a group's buckets are
        # launched strictly in bucket order (the same list on every rank): a ready bucket waits for
        # the earlier ones of its group.
        self._group_order: dict[int, list[int]] = {}
        for i, (_, group) in enumerate(self._groups):
            self._group_order.setdefault(id(group), []).append(i)
        self._next: dict[int, int] = {}  # id(group) -> position in its order of the next launch
        self._ready: set[int] = set()
        self._handles = [hook_params[name].register_post_accumulate_grad_hook(self._hook(name))
                         for name in self._bucket_of]

    def arm(self, chunk: int | None = None) -> None:
        """The next backward is ``chunk``'s last before ``reduce()`` (None: every chunk's): its
        parameters' gradients are final as their hooks fire, and buckets launch as they complete."""
        if not self._armed:  # the iteration's first arm
            self._armed = True
            self.launched_in_backward = 0
            self._pending = {i: set(b.names) for i, (b, _) in enumerate(self._groups)}
            self._next = {key: 0 for key in self._group_order}
            self._ready = set()
            self._armed_chunks = set()
        self._armed_chunks.add(chunk)

    def _final(self, name: str) -> bool:
        """Whether ``name``'s hook now reports its iteration's final gradient."""
        if None in self._armed_chunks or self._chunk_of is None:
            return True
        return self._chunk_of.get(name, 0) in self._armed_chunks

    def _hook(self, name: str):
        def hook(_param: torch.Tensor) -> None:
            if not self._armed or not self._final(name):
                return
            for i in self._bucket_of[name]:
                waiting = self._pending.get(i)
                if waiting is None:
                    continue
                waiting.discard(name)
                if not waiting:
                    del self._pending[i]
                    group = self._groups[i][1]
                    if _is_async(group):  # a bridged bucket waits for reduce() (no deadlock)
                        self._ready.add(i)
                        self._launch_ready(id(group))

        return hook

    def _launch_ready(self, key: int) -> None:
        """Launch the group's ready buckets that are next in its order."""
        order = self._group_order[key]
        while self._next[key] < len(order) and order[self._next[key]] in self._ready:
            self._launch(order[self._next[key]])
            self._next[key] += 1
            self.launched_in_backward += 1

    def _launch(self, i: int) -> None:
        bucket, group = self._groups[i]
        flat = self._pack(bucket)
        self._inflight[i] = (flat, _start_all_reduce(group, flat))

    def reduce(self) -> None:
        """Finish every bucket: wait for the launched ones, launch and wait for the rest."""
        for i in range(len(self._groups)):
            if i not in self._inflight:
                self._launch(i)
        for i, (bucket, _) in enumerate(self._groups):
            flat, work = self._inflight.pop(i)
            if work is not None:
                work.wait()
            self._unpack(bucket, flat)
        self._armed = False
        self._pending = {}
        self._ready = set()
        self._armed_chunks = set()

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (before dropping the synchronizer while keeping the params)."""
        for h in self._handles:
            h.remove()
        self._handles = []
