"""A failed pipeline transfer names the peer's global rank, island and stage (#21 item 9): gloo's
own errors ("Connection closed by peer", "Timed out waiting") name no peer. Batches go out as one
``batch_isend_irecv`` on the boundary's group, or piece by piece through a het bridge."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_het.runtime.boundary import (
    BoundaryError,
    BoundaryLink,
    Neighbour,
    finish_ops,
    split_receives,
    start_ops,
)

GLOO = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242\nmore"


class _Work:
    def __init__(self, error: str | None = None) -> None:
        self.error = error

    def wait(self):
        if self.error:
            raise RuntimeError(self.error)


def _link(**next_stage) -> BoundaryLink:
    return BoundaryLink(tp_rank=0, tp=1, prev=Neighbour(ranks=(2, 3), island="slow", stage=1, group="g-prev"),
                        next=Neighbour(ranks=(6,), group="g-next", **next_stage))


class _Op:  # torch's P2POp resolves the peer in its group, which needs an initialised world
    def __init__(self, op, tensor, peer, group=None, tag=0):
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


def _batch(monkeypatch, works):
    posted = []
    monkeypatch.setattr(dist, "P2POp", _Op)

    def batch(ops):
        posted.append([(op.op.__name__, op.peer, op.group, op.tag) for op in ops])
        return works(len(ops))

    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    return posted


def test_receive_failure_names_rank_island_and_stage(monkeypatch):
    _batch(monkeypatch, lambda n: [_Work(GLOO)] * n)
    _, ops = _link().recv_ops((4, 1, 8), torch.float32, downstream=False, message=5)
    with pytest.raises(BoundaryError, match=r"^pipeline receive of micro-batch 5 with rank 2 \(island slow, stage 1\) "
                                            r"failed: \[.*\] Connection closed by peer \[127.0.0.1\]:4242\. Fix: .*"
                                            r"--distributed-timeout-minutes\)$") as err:
        finish_ops(start_ops(ops))
    assert isinstance(err.value.__cause__, RuntimeError)


def test_a_step_with_one_neighbour_is_one_batch_on_its_group(monkeypatch):
    posted = _batch(monkeypatch, lambda n: [_Work()] * n)
    link = _link(island="fast", stage=3)
    buf, recv = link.recv_ops((4, 1, 8), torch.float32, downstream=True, message=0)  # B0's gradient in
    send = link.send_ops(torch.zeros(4, 1, 8), downstream=True, message=1)  # F1's activation out
    finish_ops(start_ops(send + recv))
    assert posted == [[("isend", 6, "g-next", 1 * 2 + 0), ("irecv", 6, "g-next", 0 * 2 + 1)]]
    assert buf.shape == (4, 1, 8)


def test_a_coalesced_batch_failure_names_every_piece(monkeypatch):
    _batch(monkeypatch, lambda n: [_Work(GLOO)])  # NCCL/RCCL: one work for the whole batch
    link = _link(island="fast", stage=3)
    ops = link.send_ops(torch.zeros(4, 1, 8), downstream=True, message=2)
    ops += link.recv_ops((4, 1, 8), torch.float32, downstream=True, message=0)[1]
    with pytest.raises(BoundaryError, match=r"pipeline send of micro-batch 2, receive of micro-batch 0 with rank 6 "
                                            r"\(island fast, stage 3\) failed"):
        finish_ops(start_ops(ops))


def test_neighbour_without_island_still_names_the_rank(monkeypatch):
    _batch(monkeypatch, lambda n: [_Work(GLOO)] * n)
    link = _link()
    link.prev = Neighbour(ranks=(9,))  # constructed as before #21: no island or stage known
    with pytest.raises(BoundaryError, match=r"pipeline send of micro-batch 0 with rank 9 failed"):
        finish_ops(start_ops(link.send_ops(torch.zeros(4, 1, 8), downstream=False, message=0)))


def test_a_bridged_neighbour_gets_each_piece_through_its_bridge(monkeypatch):
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: pytest.fail("a bridged boundary has no native group"))
    calls = []

    class Bridge:
        def isend(self, tensor, dst, tag):
            calls.append(("isend", dst, tag))
            return _Work()

        def irecv(self, buf, src, tag):
            calls.append(("irecv", src, tag))
            return _Work()

    link = BoundaryLink(tp_rank=0, tp=1, prev=None, next=Neighbour(ranks=(6,), bridge=Bridge()))
    ops = link.send_ops(torch.zeros(2), downstream=True, message=3) + link.recv_ops(
        (2,), torch.float32, downstream=True, message=1)[1]
    finish_ops(start_ops(ops))
    assert calls == [("isend", 6, 6), ("irecv", 6, 3)]


class _Flight(_Work):
    def is_completed(self) -> bool:
        return False


def test_only_receiving_batches_gate_the_next_action():
    """A batch that receives is waited for before the next action; a batch of sends only is not (the
    executor waits for it a step later, runtime/executor.py)."""
    link = _link(island="fast", stage=3)
    send = link.send_ops(torch.zeros(4, 1, 8), downstream=True, message=1)
    recv = link.recv_ops((4, 1, 8), torch.float32, downstream=True, message=0)[1]
    gloo = [(_Flight(), (op,)) for op in send + recv]  # one work per piece
    nccl = [(_Flight(), tuple(send + recv))]  # one coalesced work for the batch
    assert split_receives(gloo) == ([gloo[1]], [gloo[0]])
    assert split_receives(nccl) == (nccl, [])


def test_a_batch_with_one_stage_over_two_bridges_sends_each_piece_on_its_own(monkeypatch):
    """Two-stage interleaving: the boundary and the wrap boundary join the same stages (one batch) but
    are two bridge groups; each piece must go through its own link's."""
    calls = []

    class Bridge:
        def __init__(self, name):
            self.name = name

        def isend(self, tensor, dst, tag):
            calls.append((self.name, "isend", tag))
            return _Work()

        def irecv(self, buf, src, tag):
            calls.append((self.name, "irecv", tag))
            return _Work()

    ahead = BoundaryLink(tp_rank=0, tp=1, prev=None, next=Neighbour(ranks=(1,), stage=1, bridge=Bridge("boundary")))
    wrap = BoundaryLink(tp_rank=0, tp=1, prev=Neighbour(ranks=(1,), stage=1, bridge=Bridge("wrap")), next=None)
    assert ahead.next == wrap.prev  # one peer: the executor puts both into one batch
    ops = ahead.send_ops(torch.zeros(2), downstream=True, message=2) + wrap.recv_ops(
        (2,), torch.float32, downstream=False, message=1)[1]
    finish_ops(start_ops(ops))
    assert calls == [("boundary", "isend", 4), ("wrap", "irecv", 2)]
