"""Overlapped gradient reduction under an interleaved schedule arms each model chunk at its own last
backward (issue #36 review): armed once before the rank's very last backward, chunk 1's buckets
(whose gradients are final earlier) never launched during the backward, and since a group's buckets
launch in bucket order, chunk 0's buckets of the same group waited behind them for ``reduce()``.

Two replicas of a two-stage interleaved pipeline (V = 2) over 4 ranks, fresh from the seed, small
buckets: every bucket of every rank is launched during the backward, and the losses equal the
same plan without overlap within 1e-6 relative (a different summation grouping only).
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_het.cluster import ModelSpec
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import run_local
from megatron_het.runtime.executor import grad_reduce_triggers
from megatron_het.schedule import build_schedule
from megatron_het.train.config import TrainConfig

from workers.overlap_workers import interleaved_overlap_worker

MODEL = ModelSpec(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=128)
TRAIN = TrainConfig(micro_batch_size=1, global_batch_size=8, train_iters=2, lr=1e-3)


def _stage(ranks, layers, chunks):
    return StagePlan(island="cpu", device_type="CPU", ranks=tuple(ranks), layers=layers, chunk_layers=chunks)


PLAN = Plan(replicas=tuple(ReplicaPlan(stages=(_stage([r], (0, 2), ((0, 1), (2, 3))),
                                               _stage([r + 1], (2, 4), ((1, 2), (3, 4)))), num_micro_batches=4)
                           for r in (0, 2)),
            micro_batch_size=1, global_batch_size=8, schedule="interleaved", virtual_pipeline_size=2,
            precision="fp32")


def test_each_chunk_is_armed_at_its_own_last_backward():
    for acts in build_schedule("interleaved", 2, 4, 2).actions:
        triggers = grad_reduce_triggers(acts)
        assert sorted(triggers.values()) == [0, 1]
        for i, chunk in triggers.items():
            assert acts[i].kind in ("B", "BW") and acts[i].chunk == chunk
            assert not any(a.kind in ("B", "BW") and a.chunk == chunk for a in acts[i + 1:])


@pytest.mark.multiproc
def test_interleaved_buckets_all_launch_in_the_backward():
    cases = [("plain", PLAN, TRAIN),
             ("overlap", PLAN, dataclasses.replace(TRAIN, overlap_grad_reduce=True, ddp_bucket_size=2000))]
    per_rank = run_local(4, interleaved_overlap_worker, (MODEL, cases), timeout_s=600)
    plain, overlap = per_rank[-1]["plain"]["losses"], per_rank[-1]["overlap"]["losses"]
    assert overlap == pytest.approx(plain, rel=1e-6), (overlap, plain)
    for rank, out in enumerate(per_rank):
        launched, buckets = out["overlap"]["launched"]
        print(f"rank {rank}: {launched} of {buckets} buckets launched during the backward")
        assert buckets > 2 and launched == buckets, (rank, launched, buckets)
