"""Rank by rank, the batches the executor posts for uneven-TP pipelines complete under NCCL's weakest
promise (schedule/stream_model.py), with every piece meeting a receive of its own shape and tag.

The schedule-level model (tests/unit/schedule/test_transfer_streams.py) treats a stage as one
device. Here each rank is one: its ``ActionExecutor`` builds every batch with the real
``BoundaryLink`` pieces (receiver j served by sender j % tp, or sequence-parallel row pieces), and
the pieces are played instead of posted. Stages of TP 2, 1, 4 (and 4, 2 with interleaving's wrap).
"""

from __future__ import annotations

import pytest
import torch

import megatron_het.runtime.executor as executor_module
from megatron_het.runtime.boundary import BoundaryLink, Neighbour, shard_rows
from megatron_het.runtime.executor import ActionExecutor
from megatron_het.schedule import build_schedule
from megatron_het.schedule.stream_model import StreamOp, run_streams
from megatron_het.schedule.transfers import Post, stage_transfer_steps

SEQ, H = 8, 4


def _rank_kernels(tps, schedule, *, sequence_parallel, monkeypatch):
    starts = [sum(tps[:s]) for s in range(len(tps))]
    ranks = [tuple(range(starts[s], starts[s] + tp)) for s, tp in enumerate(tps)]
    p, v = len(tps), schedule.num_chunks
    captured: list = []
    monkeypatch.setattr(executor_module, "start_ops", lambda ops: captured.extend(ops) or [])
    kernels = {}
    for s, tp in enumerate(tps):
        def neighbour(t):
            return Neighbour(ranks=ranks[t], stage=t)

        for tp_rank in range(tp):
            def link(c, s=s, tp=tp, tp_rank=tp_rank):
                prev = neighbour(s - 1) if s > 0 else (neighbour(p - 1) if c > 0 else None)
                nxt = neighbour(s + 1) if s < p - 1 else (neighbour(0) if c < v - 1 else None)
                return BoundaryLink(tp_rank=tp_rank, tp=tp, prev=prev, next=nxt,
                                    sequence_parallel=sequence_parallel)

            acts = schedule.actions[s]
            ex = ActionExecutor(actions=acts, links=dict.fromkeys(range(schedule.num_micro_batches), link(0)),
                                is_first=s == 0, is_last=s == p - 1, act_shape=(SEQ, 1, H), dtype=torch.float32,
                                micro_batch_size=1, loss_scale=1.0, num_chunks=v,
                                chunk_links={c: link(c) for c in range(1, v)},
                                steps=stage_transfer_steps(schedule, s))
            rows = shard_rows(SEQ, tp, tp_rank) if sequence_parallel else (0, SEQ)  # TP 1: the whole sequence
            result = torch.zeros(rows[1] - rows[0], 1, H)
            mine = []
            for step in ex.steps:
                if isinstance(step, Post):
                    captured.clear()
                    ex._post(step, {}, dict.fromkeys(step.sends, result))
                    if captured:  # a rank with no piece in a batch posts nothing
                        mine.append([StreamOp(send=op.send, peer=op.rank, message=(op.tag, tuple(op.tensor.shape)))
                                     for op in captured])
            kernels[ranks[s][tp_rank]] = mine
    return kernels


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "gpipe"])
def test_uneven_tp_pipeline_ranks_complete(name, sequence_parallel, monkeypatch):
    for m in (1, 3, 6):
        kernels = _rank_kernels((2, 1, 4), build_schedule(name, 3, m), sequence_parallel=sequence_parallel,
                                monkeypatch=monkeypatch)
        outcome = run_streams(kernels)
        assert outcome.ok, (m, outcome)
        assert sum(len(k) for k in kernels.values()) > 0


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_uneven_tp_interleaved_ranks_complete_through_the_wrap(sequence_parallel, monkeypatch):
    for tps, m in (((4, 2), 4), ((4, 2), 6), ((2, 1, 4), 6)):
        kernels = _rank_kernels(tps, build_schedule("interleaved", len(tps), m, 2),
                                sequence_parallel=sequence_parallel, monkeypatch=monkeypatch)
        assert run_streams(kernels).ok, (tps, m)


def test_a_rank_whose_piece_goes_missing_is_reported(monkeypatch):
    kernels = _rank_kernels((2, 1), build_schedule("1f1b", 2, 2), sequence_parallel=False, monkeypatch=monkeypatch)
    kernels[2] = [k for k in kernels[2] if not any(op.send for op in k)]  # rank 2 never sends its gradients
    outcome = run_streams(kernels)
    assert outcome.stuck and any("rank" not in m and "receives" in m for m in outcome.mismatches)
