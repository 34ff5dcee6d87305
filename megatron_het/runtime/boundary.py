"""Activations forward and gradients backward between stages of different TP sizes.

Without sequence parallelism a stage's output hidden states are replicated on all its TP ranks, and
the gradient w.r.t. a stage's input is replicated on all of its TP ranks (megatron's
``copy_to_tensor_model_parallel_region`` all-reduces it). So each rank on one side needs one whole
copy from one rank on the other side. Pairing receiver j with sender ``j % sender_tp`` spreads the
sends over all sender ranks and works for any (a, b): TP 1 -> 2, 2 -> 4, 4 -> 2, 3 -> 2, ...

megatron-core's ``BridgeCommunicator`` does leader-to-leader then a broadcast inside the TP group
and creates its groups with ``backend='nccl'`` (bridge_communicator.py ~199/209); it also needs
``variable_seq_lengths`` (only valid with the alltoall MoE dispatcher). Our schedule executor sends
point-to-point with tags per micro-batch instead, which needs no extra groups and no broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

FORWARD, BACKWARD = 0, 1


def sender_for(receiver_tp_rank: int, sender_tp: int) -> int:
    """TP rank on the sending side that serves ``receiver_tp_rank``."""
    return receiver_tp_rank % sender_tp


def receivers_of(sender_tp_rank: int, sender_tp: int, receiver_tp: int) -> list[int]:
    """TP ranks on the receiving side that ``sender_tp_rank`` sends to (possibly none)."""
    return [j for j in range(receiver_tp) if j % sender_tp == sender_tp_rank]


def tag(micro_batch: int, direction: int) -> int:
    return micro_batch * 2 + direction


@dataclass(frozen=True, kw_only=True)
class Neighbour:
    """The adjacent stage of one rank: its ranks in TP order."""

    ranks: tuple[int, ...]

    @property
    def tp(self) -> int:
        return len(self.ranks)


class BoundaryLink:
    """Point-to-point transfers of one rank with its previous and next stage."""

    def __init__(self, *, tp_rank: int, tp: int, prev: Neighbour | None, next: Neighbour | None) -> None:
        self.tp_rank, self.tp = tp_rank, tp
        self.prev, self.next = prev, next
        self._pending: list[dist.Work] = []

    def send_forward(self, tensor: torch.Tensor, micro_batch: int) -> None:
        for j in receivers_of(self.tp_rank, self.tp, self.next.tp):
            self._pending.append(dist.isend(tensor.contiguous(), self.next.ranks[j], tag=tag(micro_batch, FORWARD)))

    def recv_forward(self, shape, dtype, micro_batch: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype)
        dist.recv(buf, self.prev.ranks[sender_for(self.tp_rank, self.prev.tp)], tag=tag(micro_batch, FORWARD))
        return buf

    def send_backward(self, tensor: torch.Tensor, micro_batch: int) -> None:
        for j in receivers_of(self.tp_rank, self.tp, self.prev.tp):
            self._pending.append(dist.isend(tensor.contiguous(), self.prev.ranks[j], tag=tag(micro_batch, BACKWARD)))

    def recv_backward(self, shape, dtype, micro_batch: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype)
        dist.recv(buf, self.next.ranks[sender_for(self.tp_rank, self.next.tp)], tag=tag(micro_batch, BACKWARD))
        return buf

    def drain(self) -> None:
        """Wait for every posted send (end of an iteration)."""
        for work in self._pending:
            work.wait()
        self._pending.clear()
