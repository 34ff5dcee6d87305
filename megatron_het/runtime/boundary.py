"""Activations forward and gradients backward between stages of different TP sizes.

Without sequence parallelism a stage's output hidden states are replicated on all its TP ranks, and
the gradient w.r.t. a stage's input is replicated on all of its TP ranks (megatron's
``copy_to_tensor_model_parallel_region`` all-reduces it). So each rank on one side needs one whole
copy from one rank on the other side. Pairing receiver j with sender ``j % sender_tp`` spreads the
sends over all sender ranks and works for any (a, b): TP 1 -> 2, 2 -> 4, 4 -> 2, 3 -> 2, ...

With sequence parallelism (megatron's ``sequence_parallel`` on a stage of TP > 1) TP rank i of a
stage holds only rows ``[i*s/tp, (i+1)*s/tp)`` of the sequence, both of its output activations and
of its input gradient. The two sides are then re-split point to point: each receiver gets, from
every sender whose rows overlap its own, exactly the overlapping rows (``sequence_transfers``).
Every element crosses the boundary once (s*b*h per micro-batch and direction, against
``receiver_tp`` whole copies without sequence parallelism), and no TP all-gather is needed on
either side. A TP=1 stage holds the whole sequence, so TP 2 -> 1 -> 4 works the same way.
A 3D tensor-parallel stage (plan ``tp_grid``) has no sequence parallelism (z splits the batch):
each of its ranks holds the whole sequence at both ends, so beside a sequence-parallel stage it is
a side of one row block (as TP=1) copied on all its ranks (``full_sequence``): every copy receives
each row once, and receiver j of the other side is sent its rows by copy ``j % ranks``.

megatron-core's ``BridgeCommunicator`` does leader-to-leader then a broadcast inside the TP group
and creates its groups with ``backend='nccl'`` (bridge_communicator.py ~199/209); it also needs
``variable_seq_lengths`` (only valid with the alltoall MoE dispatcher). Our schedule executor sends
point-to-point with tags per micro-batch instead (no broadcast), on one group per direction of each
boundary (``boundary_groups.py``: NCCL and RCCL deadlock with both directions on one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

FORWARD, BACKWARD = 0, 1


def _host_device() -> torch.device:
    from megatron_het.platform import HOST_DEVICE

    return HOST_DEVICE


def sender_for(receiver_tp_rank: int, sender_tp: int) -> int:
    """TP rank on the sending side that serves ``receiver_tp_rank`` (replicated activations)."""
    return receiver_tp_rank % sender_tp


def receivers_of(sender_tp_rank: int, sender_tp: int, receiver_tp: int) -> list[int]:
    """TP ranks on the receiving side that ``sender_tp_rank`` sends to (possibly none)."""
    return [j for j in range(receiver_tp) if j % sender_tp == sender_tp_rank]


def shard_rows(seq_length: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """[start, stop) sequence rows held by ``tp_rank`` under sequence parallelism."""
    if seq_length % tp:
        raise ValueError(f"seq_length: sequence parallelism needs the TP size {tp} to divide seq_length "
                         f"{seq_length}. Fix: use a TP size that divides {seq_length} or turn sequence_parallel off")
    rows = seq_length // tp
    return tp_rank * rows, (tp_rank + 1) * rows


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """One point-to-point piece of a sequence-parallel boundary."""

    sender: int  # TP rank on the sending side
    receiver: int  # TP rank on the receiving side
    rows: tuple[int, int]  # [start, stop) global sequence rows carried


def sequence_transfers(seq_length: int, sender_tp: int, receiver_tp: int) -> list[Transfer]:
    """Every (sender, receiver) pair whose sequence shards overlap, with the overlapping rows."""
    out = []
    for i in range(sender_tp):
        a0, a1 = shard_rows(seq_length, sender_tp, i)
        for j in range(receiver_tp):
            b0, b1 = shard_rows(seq_length, receiver_tp, j)
            lo, hi = max(a0, b0), min(a1, b1)
            if lo < hi:
                out.append(Transfer(sender=i, receiver=j, rows=(lo, hi)))
    return out


def _row_blocks(tp: int, full_sequence: bool) -> int:
    """Sequence row blocks a stage's ranks hold under sequence parallelism: one per TP rank, or one
    (the whole sequence, on every rank) for a full-sequence (3D) stage."""
    return 1 if full_sequence else tp


def tag(micro_batch: int, direction: int) -> int:
    return micro_batch * 2 + direction


@dataclass(frozen=True, kw_only=True)
class Neighbour:
    """The adjacent stage of one rank: its ranks in TP order."""

    ranks: tuple[int, ...]
    island: str | None = None  # island of that stage, named when a transfer with it fails
    stage: int | None = None  # its stage index in the replica, named when a transfer with it fails
    # the het bridge group (comm.HetGroup) of the two stages when their collective libraries differ
    # (NVIDIA beside AMD: no one communicator spans both); None: torch p2p on the default group
    bridge: object | None = field(default=None, compare=False)
    # every rank of that stage holds the whole sequence under the plan's sequence parallelism (a 3D stage)
    full_sequence: bool = False
    # this rank's group for sends to / receives from that stage: one per direction of the boundary
    # (runtime/boundary_groups.py: NCCL would deadlock with both directions on one); None: the default group
    send_group: object | None = field(default=None, compare=False)
    recv_group: object | None = field(default=None, compare=False)

    def describe(self, rank: int) -> str:
        """``rank N (island X, stage S)`` for error messages (what is known of the peer)."""
        where = [f"island {self.island}" if self.island is not None else "",
                 f"stage {self.stage}" if self.stage is not None else ""]
        where = [w for w in where if w]
        return f"rank {rank}" + (f" ({', '.join(where)})" if where else "")

    @property
    def tp(self) -> int:
        return len(self.ranks)


class BoundaryError(RuntimeError):
    """A pipeline transfer with a neighbouring stage failed or timed out; names the peer."""


def _failed(what: str, peer: Neighbour, rank: int, micro_batch: int, err: BaseException) -> BoundaryError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else err.__class__.__name__
    return BoundaryError(f"pipeline {what} of micro-batch {micro_batch} with {peer.describe(rank)} failed: {first}. "
                         "Fix: look at that rank's log: it died, or is stuck (waits are bounded by "
                         "--distributed-timeout-minutes)")


def _finish_send(work, peer: Neighbour, dst: int, t: int) -> None:
    try:
        work.wait()
    except RuntimeError as err:
        raise _failed("send", peer, dst, t // 2, err) from err


class BoundaryLink:
    """Point-to-point transfers of one rank with its previous and next stage.

    ``shape`` arguments are always the full ``[s, b, h]`` activation shape; with
    ``sequence_parallel`` the tensors sent and returned are this rank's ``[s/tp, b, h]`` shard.
    """

    def __init__(self, *, tp_rank: int, tp: int, prev: Neighbour | None, next: Neighbour | None,
                 sequence_parallel: bool = False, full_sequence: bool = False,
                 device: torch.device | None = None) -> None:
        self.tp_rank, self.tp = tp_rank, tp
        self.prev, self.next = prev, next
        # where received activations/gradients are placed: the accelerator's device (None: the host)
        self.device = device if device is not None else _host_device()
        # the plan's flag: a stage of TP > 1 holds a sequence shard; TP = 1 holds the whole sequence
        self.sequence_parallel = sequence_parallel
        self.full_sequence = full_sequence  # this stage holds the whole sequence on every rank (a 3D stage)
        self._pending: list[tuple[dist.Work, Neighbour, int, int]] = []  # (send, peer stage, its rank, tag)

    def send_forward(self, tensor: torch.Tensor, micro_batch: int) -> None:
        self._send(tensor, self.next, tag(micro_batch, FORWARD))

    def recv_forward(self, shape, dtype, micro_batch: int) -> torch.Tensor:
        return self._recv(shape, dtype, self.prev, tag(micro_batch, FORWARD))

    def send_backward(self, tensor: torch.Tensor, micro_batch: int) -> None:
        self._send(tensor, self.prev, tag(micro_batch, BACKWARD))

    def recv_backward(self, shape, dtype, micro_batch: int) -> torch.Tensor:
        return self._recv(shape, dtype, self.next, tag(micro_batch, BACKWARD))

    @staticmethod
    def _isend(tensor: torch.Tensor, peer: Neighbour, dst: int, t: int):
        if peer.bridge is not None:  # across collective libraries: the bridge stages through the host
            return peer.bridge.isend(tensor, dst, tag=t)
        return dist.isend(tensor, dst, tag=t, group=peer.send_group)

    @staticmethod
    def _irecv(buf: torch.Tensor, peer: Neighbour, src: int, t: int):
        if peer.bridge is not None:
            return peer.bridge.irecv(buf, src, tag=t)
        return dist.irecv(buf, src, tag=t, group=peer.recv_group)

    def _send(self, tensor: torch.Tensor, peer: Neighbour, t: int) -> None:
        if not self.sequence_parallel:
            for j in receivers_of(self.tp_rank, self.tp, peer.tp):
                self._pending.append((self._isend(tensor.contiguous(), peer, peer.ranks[j], t), peer, peer.ranks[j], t))
            return
        mine, peer_rows = _row_blocks(self.tp, self.full_sequence), _row_blocks(peer.tp, peer.full_sequence)
        block = 0 if self.full_sequence else self.tp_rank
        seq = tensor.shape[0] * mine
        start = shard_rows(seq, mine, block)[0]
        for tr in sequence_transfers(seq, mine, peer_rows):
            # a full-sequence peer: every rank receives the rows; a full-sequence self: copy j % tp sends to j
            for j in range(peer.tp) if peer.full_sequence else (tr.receiver,):
                if (j % self.tp if self.full_sequence else tr.sender) != self.tp_rank:
                    continue
                piece = tensor[tr.rows[0] - start:tr.rows[1] - start].contiguous()
                self._pending.append((self._isend(piece, peer, peer.ranks[j], t), peer, peer.ranks[j], t))

    def _recv(self, shape, dtype, peer: Neighbour, t: int) -> torch.Tensor:
        if not self.sequence_parallel:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            src = peer.ranks[sender_for(self.tp_rank, peer.tp)]
            try:
                if peer.bridge is not None:  # across collective libraries: through the bridge
                    peer.bridge.recv(buf, src, tag=t)
                else:
                    dist.recv(buf, src, tag=t, group=peer.recv_group)
            except RuntimeError as err:  # gloo names no peer: say which rank, island and stage
                raise _failed("receive", peer, src, t // 2, err) from err
            return buf
        seq = shape[0]
        mine, peer_rows = _row_blocks(self.tp, self.full_sequence), _row_blocks(peer.tp, peer.full_sequence)
        block = 0 if self.full_sequence else self.tp_rank
        start, stop = shard_rows(seq, mine, block)
        buf = torch.empty((stop - start, *shape[1:]), dtype=dtype, device=self.device)

        def src(tr: Transfer) -> int:  # a full-sequence peer: its copy tp_rank % peer.tp serves this rank
            return peer.ranks[self.tp_rank % peer.tp if peer.full_sequence else tr.sender]

        works = [(self._irecv(buf[tr.rows[0] - start:tr.rows[1] - start], peer, src(tr), t), src(tr))
                 for tr in sequence_transfers(seq, peer_rows, mine) if tr.receiver == block]
        for w, rank in works:  # dim-0 slices of a contiguous buffer are contiguous: received in place
            try:
                w.wait()
            except RuntimeError as err:
                raise _failed("receive", peer, rank, t // 2, err) from err
        return buf

    def drain(self) -> None:
        """Wait for every posted send (end of an iteration)."""
        for entry in self._pending:
            _finish_send(*entry)
        self._pending.clear()

    def release_completed(self) -> int:
        """Forget the sends that have completed (never waits), so their buffers are freed as the
        schedule goes rather than held to the end of the iteration; the number still in flight.
        NCCL/RCCL and the het backend report completion; torch's gloo send reports it only after
        ``wait()``, so on the host every send is still released at ``drain()``."""
        still = []
        for entry in self._pending:
            if entry[0].is_completed():
                _finish_send(*entry)  # done: raises here if it failed
            else:
                still.append(entry)
        self._pending = still
        return len(still)

    def abandon(self) -> None:
        """Forget every posted send without waiting (a failed iteration's group is being torn down)."""
        self._pending.clear()


def order_mismatches(actions_per_stage) -> list[str]:
    """Where neighbour stages would post boundary transfers in different micro-batch orders (pure).

    On backends without p2p tags (NCCL, RCCL) the n-th send between two ranks meets the n-th receive,
    so stage s must send forward activations in the order stage s+1 receives them, and stage s+1
    must send input gradients in the order stage s receives them. ``actions_per_stage``: one
    replica's action lists (``schedule.Action``), stage order. Empty: matching by order is correct.
    """
    out = []

    def order(actions, kinds):
        return [a.micro_batch for a in actions if a.kind in kinds]

    for s in range(len(actions_per_stage) - 1):
        up, down = actions_per_stage[s], actions_per_stage[s + 1]
        if order(up, ("F",)) != order(down, ("F",)):
            out.append(f"stage {s} sends activations in order {order(up, ('F',))}, stage {s + 1} receives "
                       f"{order(down, ('F',))}")
        if order(down, ("B", "BW")) != order(up, ("B", "BW")):
            out.append(f"stage {s + 1} sends gradients in order {order(down, ('B', 'BW'))}, stage {s} receives "
                       f"{order(up, ('B', 'BW'))}")
    return out
