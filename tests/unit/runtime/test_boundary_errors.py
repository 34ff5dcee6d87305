"""A failed pipeline transfer names the peer's global rank, island and stage (#21 item 9): gloo's
own errors ("Connection closed by peer", "Timed out waiting") name no peer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_het.runtime.boundary import BoundaryError, BoundaryLink, Neighbour

GLOO = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242\nmore"


class _BrokenWork:
    def wait(self):
        raise RuntimeError(GLOO)


def _link(**next_stage) -> BoundaryLink:
    return BoundaryLink(tp_rank=0, tp=1, prev=Neighbour(ranks=(2, 3), island="slow", stage=1),
                        next=Neighbour(ranks=(6,), **next_stage))


def test_receive_failure_names_rank_island_and_stage(monkeypatch):
    def recv(buf, src, tag, group=None):
        raise RuntimeError(GLOO)

    monkeypatch.setattr(dist, "recv", recv)
    with pytest.raises(BoundaryError, match=r"^pipeline receive of micro-batch 5 with rank 2 \(island slow, stage 1\) "
                                            r"failed: \[.*\] Connection closed by peer \[127.0.0.1\]:4242\. Fix: .*"
                                            r"--distributed-timeout-minutes\)$") as err:
        _link().recv_forward((4, 1, 8), torch.float32, micro_batch=5)
    assert isinstance(err.value.__cause__, RuntimeError)


def test_send_failure_names_the_receiver_at_drain(monkeypatch):
    monkeypatch.setattr(dist, "isend", lambda tensor, dst, tag, group=None: _BrokenWork())
    link = _link(island="fast", stage=3)
    link.send_forward(torch.zeros(4, 1, 8), micro_batch=2)
    with pytest.raises(BoundaryError, match=r"pipeline send of micro-batch 2 with rank 6 \(island fast, stage 3\)"):
        link.drain()


def test_neighbour_without_island_still_names_the_rank(monkeypatch):
    monkeypatch.setattr(dist, "isend", lambda tensor, dst, tag, group=None: _BrokenWork())
    link = _link()  # constructed as before this change: no island or stage known
    link.send_backward(torch.zeros(4, 1, 8), micro_batch=0)
    link.prev = Neighbour(ranks=(2, 3))
    link.send_backward(torch.zeros(4, 1, 8), micro_batch=0)
    with pytest.raises(BoundaryError, match=r"with rank 2 \(island slow, stage 1\) failed"):
        link.drain()
    assert Neighbour(ranks=(9,)).describe(9) == "rank 9"


class _Work:
    def __init__(self, done: bool, error: str | None = None) -> None:
        self.done, self.error, self.waited = done, error, False

    def is_completed(self) -> bool:
        return self.done

    def wait(self):
        self.waited = True
        if self.error:
            raise RuntimeError(self.error)


def test_completed_sends_are_released_without_waiting_for_the_rest(monkeypatch):
    """Sends no longer live to the end of the iteration (#36): after each action the executor drops the
    completed ones (their buffers freed); one still in flight is kept, a failed one names its peer."""
    works = iter([_Work(True), _Work(False), _Work(True, error=GLOO)])
    monkeypatch.setattr(dist, "isend", lambda tensor, dst, tag, group=None: next(works))
    link = _link(island="fast", stage=3)
    link.send_forward(torch.zeros(4, 1, 8), micro_batch=0)
    link.send_forward(torch.zeros(4, 1, 8), micro_batch=1)
    assert link.release_completed() == 1  # micro-batch 0's send released, 1's in flight
    assert [t // 2 for _, _, _, t in link._pending] == [1] and not link._pending[0][0].waited
    link.send_forward(torch.zeros(4, 1, 8), micro_batch=2)
    with pytest.raises(BoundaryError, match=r"pipeline send of micro-batch 2 with rank 6 \(island fast, stage 3\)"):
        link.release_completed()
