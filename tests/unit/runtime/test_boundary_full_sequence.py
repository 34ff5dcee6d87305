"""A 3D stage (plan tp_grid) beside sequence-parallel stages: it holds the whole sequence on every
rank (``full_sequence``), the other side row shards. Simulated without processes: every sender's
pieces are recorded, every receiver takes what was addressed to it; each receiver must end with
exactly its rows (each row once), in both directions and for 3D beside 3D."""

from __future__ import annotations

import pytest
import torch

from megatron_het.runtime.boundary import BoundaryLink, Neighbour, shard_rows

SEQ, B, H = 12, 2, 3


def _rows(first: int, stop: int) -> torch.Tensor:
    """Rows [first, stop) of the full activation, each row's entries = its row index."""
    return torch.arange(first, stop, dtype=torch.float32)[:, None, None].expand(-1, B, H).contiguous()


@pytest.mark.parametrize(("send_tp", "send_full", "recv_tp", "recv_full"), [
    (2, False, 4, True),  # TP=2 sequence-parallel -> [2,2,1] 3D stage
    (4, True, 2, False),  # 3D -> TP=2 sequence-parallel
    (4, True, 3, False),  # 3D -> TP=3 (receivers beyond the copies' count)
    (3, False, 4, True),
    (2, True, 4, True),  # 3D -> 3D
    (1, False, 4, True),  # TP=1 (whole sequence, one rank) -> 3D
    (2, False, 3, False),  # unchanged: sequence-parallel both sides
])
def test_each_receiver_gets_its_rows_exactly_once(send_tp, send_full, recv_tp, recv_full):
    senders, receivers = tuple(range(send_tp)), tuple(range(100, 100 + recv_tp))
    sent: dict[tuple[int, int], list[torch.Tensor]] = {}
    for i in range(send_tp):
        link = BoundaryLink(tp_rank=i, tp=send_tp, prev=None, sequence_parallel=True, full_sequence=send_full,
                            next=Neighbour(ranks=receivers, full_sequence=recv_full))
        held = (0, SEQ) if send_full else shard_rows(SEQ, send_tp, i)
        for op in link.send_ops(_rows(*held), downstream=True, message=0):
            sent.setdefault((senders[i], op.rank), []).append(op.tensor.clone())
    got = {}
    for j in range(recv_tp):
        link = BoundaryLink(tp_rank=j, tp=recv_tp, next=None, sequence_parallel=True, full_sequence=recv_full,
                            prev=Neighbour(ranks=senders, full_sequence=send_full))
        got[j], ops = link.recv_ops((SEQ, B, H), torch.float32, downstream=False, message=0)
        for op in ops:
            op.tensor.copy_(sent[(op.rank, receivers[j])].pop(0))  # a shape mismatch fails here
    for j, buf in got.items():
        want = (0, SEQ) if recv_full else shard_rows(SEQ, recv_tp, j)
        assert torch.equal(buf, _rows(*want)), (j, buf[:, 0, 0])
    assert not any(sent.values()), "pieces sent that nobody received"
