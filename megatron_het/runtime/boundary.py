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
``variable_seq_lengths`` (only valid with the alltoall MoE dispatcher). Here each rank sends its
pieces point to point instead (no broadcast): ``send_ops``/``recv_ops`` list them, and the schedule
executor posts a step's pieces with one neighbour in one ``batch_isend_irecv`` on that boundary's
group (``boundary_groups.py``, ``schedule/transfers.py``), waits for the batches that receive before
the next step computes and for those of sends only a step later (``runtime/executor.py``).
Tags name the micro-batch and direction; gloo matches by them, NCCL and RCCL by order, which the
start-up check compares (``schedule/stream_model.py``).
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
    # the group of this boundary (runtime/boundary_groups.py: one per pair of neighbour stages, both
    # directions); None: the default group
    group: object | None = field(default=None, compare=False)

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


@dataclass(frozen=True, kw_only=True)
class PeerOp:
    """One point-to-point piece of a boundary transfer, ready to post."""

    send: bool  # a send (else a receive into ``tensor``)
    tensor: torch.Tensor  # what is sent, or the (contiguous) buffer received into
    peer: Neighbour  # the stage on the other end
    rank: int  # that stage's rank this piece goes to or comes from (global)
    tag: int  # ``tag(message, direction)``: gloo matches by it; NCCL/RCCL by order


def _failed(ops, err: BaseException) -> BoundaryError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else err.__class__.__name__
    what = ", ".join(f"{'send' if op.send else 'receive'} of micro-batch {op.tag // 2}" for op in ops)
    return BoundaryError(f"pipeline {what} with {ops[0].peer.describe(ops[0].rank)} failed: {first}. "
                         "Fix: look at that rank's log: it died, or is stuck (waits are bounded by "
                         "--distributed-timeout-minutes)")


def start_ops(ops) -> list[tuple[object, tuple[PeerOp, ...]]]:
    """Post ``ops`` (all with one neighbour stage) as one batch; (work, the ops it covers) to wait for.
    Native: one ``batch_isend_irecv`` on the boundary's group (NCCL/RCCL: one grouped kernel, which
    the communicator created eagerly at start-up lets span a subset of its ranks); across collective
    libraries: each piece through the het bridge."""
    # each piece through its own link's bridge: a two-stage interleaved pipeline's boundary and wrap
    # boundary join the same two stages (one batch) but have a bridge group each
    out = [((op.peer.bridge.isend if op.send else op.peer.bridge.irecv)(op.tensor, op.rank, tag=op.tag), (op,))
           for op in ops if op.peer.bridge is not None]
    native = [op for op in ops if op.peer.bridge is None]
    if not native:
        return out
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor, op.rank,
                                               group=op.peer.group, tag=op.tag) for op in native])
    if len(works) == len(native):  # gloo: one work per piece
        return out + [(w, (op,)) for w, op in zip(works, native)]
    return out + [(w, tuple(native)) for w in works]  # NCCL/RCCL: the batch's coalesced work


def finish_ops(started) -> None:
    """Wait for posted batches (``start_ops``); a failure names the pieces and the peer."""
    for work, ops in started:
        try:
            work.wait()
        except RuntimeError as err:  # gloo names no peer: say which rank, island and stage
            raise _failed(ops, err) from err


def split_receives(started) -> tuple[list, list]:
    """(works a computation must wait for: any receive among their pieces; works of sends only).
    Nothing computed next reads a send's buffer, so the executor waits for a send only one step
    later; under NCCL's weakest promise the device runs every batch in issue order anyway, so the
    stream model's verdict holds either way."""
    needed, sends = [], []
    for entry in started:
        (needed if any(not op.send for op in entry[1]) else sends).append(entry)
    return needed, sends


class BoundaryLink:
    """Point-to-point pieces of one rank's transfers with its previous and next stage.

    ``shape`` arguments are always the full ``[s, b, h]`` activation shape; with
    ``sequence_parallel`` the tensors sent and returned are this rank's ``[s/tp, b, h]`` shard.
    ``downstream``: the transfer is with the next stage (a forward's activation out, a backward's
    gradient in); ``message``: the schedule's message id (micro-batch and chunk), tagged per direction.
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

    def send_ops(self, tensor: torch.Tensor, *, downstream: bool, message: int) -> list[PeerOp]:
        """The pieces of ``tensor`` this rank sends (possibly none: a receiving stage of smaller TP)."""
        peer = self.next if downstream else self.prev
        t = tag(message, FORWARD if downstream else BACKWARD)
        if not self.sequence_parallel:
            tensor = tensor.contiguous()
            return [PeerOp(send=True, tensor=tensor, peer=peer, rank=peer.ranks[j], tag=t)
                    for j in receivers_of(self.tp_rank, self.tp, peer.tp)]
        mine, peer_rows = _row_blocks(self.tp, self.full_sequence), _row_blocks(peer.tp, peer.full_sequence)
        block = 0 if self.full_sequence else self.tp_rank
        seq = tensor.shape[0] * mine
        start = shard_rows(seq, mine, block)[0]
        out = []
        for tr in sequence_transfers(seq, mine, peer_rows):
            # a full-sequence peer: every rank receives the rows; a full-sequence self: copy j % tp sends to j
            for j in range(peer.tp) if peer.full_sequence else (tr.receiver,):
                if (j % self.tp if self.full_sequence else tr.sender) != self.tp_rank:
                    continue
                piece = tensor[tr.rows[0] - start:tr.rows[1] - start].contiguous()
                out.append(PeerOp(send=True, tensor=piece, peer=peer, rank=peer.ranks[j], tag=t))
        return out

    def recv_ops(self, shape, dtype, *, downstream: bool, message: int) -> tuple[torch.Tensor, list[PeerOp]]:
        """The buffer this rank receives into and the pieces that fill it."""
        peer = self.next if downstream else self.prev
        t = tag(message, BACKWARD if downstream else FORWARD)
        if not self.sequence_parallel:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            return buf, [PeerOp(send=False, tensor=buf, peer=peer, rank=peer.ranks[sender_for(self.tp_rank, peer.tp)],
                                tag=t)]
        seq = shape[0]
        mine, peer_rows = _row_blocks(self.tp, self.full_sequence), _row_blocks(peer.tp, peer.full_sequence)
        block = 0 if self.full_sequence else self.tp_rank
        start, stop = shard_rows(seq, mine, block)
        buf = torch.empty((stop - start, *shape[1:]), dtype=dtype, device=self.device)

        def src(tr: Transfer) -> int:  # a full-sequence peer: its copy tp_rank % peer.tp serves this rank
            return peer.ranks[self.tp_rank % peer.tp if peer.full_sequence else tr.sender]

        # dim-0 slices of a contiguous buffer are contiguous: received in place
        return buf, [PeerOp(send=False, tensor=buf[tr.rows[0] - start:tr.rows[1] - start], peer=peer, rank=src(tr),
                            tag=t) for tr in sequence_transfers(seq, peer_rows, mine) if tr.receiver == block]
