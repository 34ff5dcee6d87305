"""The staggered optimizer step alone (no failure): the same training as the synchronous step.

Four gloo ranks train a 2 replicas x 2 stages plan whose replicas cut the layers differently
(replica 0: [0,1) [1,4), replica 1: [0,3) [3,4)), so the gradient groups differ per layer, for 3
iterations twice from the same initial values: synchronous step (after the world-wide norm and loss
collectives) and staggered (each stage steps right after its own gradient reduction). Losses and
every final parameter must agree to fp32 round-off (relative 1e-6); a staggered step taken before
the reduction, or on unreduced gradients, breaks it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_het.cluster import ModelSpec
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import run_local
from megatron_het.train.config import TrainConfig

MODEL = ModelSpec(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=128)
TRAIN = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=3, lr=1e-2, clip_grad=0.0)


def plan() -> Plan:
    def stage(rank, layers):
        return StagePlan(island="cpu", device_type="CPU", ranks=(rank,), layers=layers)

    return Plan(replicas=(ReplicaPlan(stages=(stage(0, (0, 1)), stage(1, (1, 4))), num_micro_batches=2),
                          ReplicaPlan(stages=(stage(2, (0, 3)), stage(3, (3, 4))), num_micro_batches=2)),
                micro_batch_size=2, global_batch_size=8)


def worker(rank, world_size):
    from megatron_het.data.synthetic import synthetic_batch
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    enable_cpu_backend()

    def batch_fn(iteration, indices):
        return synthetic_batch(seed=1, iteration=iteration, indices=indices, seq_length=MODEL.seq_length,
                               vocab_size=MODEL.vocab_size)

    out = {}
    for staggered in (False, True):
        trainer = HeteroTrainer(model=MODEL, plan=plan(), train=TRAIN, batch_fn=batch_fn)
        trainer.strategy.staggered_step = staggered
        logs = trainer.run(3).iterations
        out[staggered] = ([log.lm_loss for log in logs],
                          {n: p.detach().clone() for n, p in trainer.strategy.gpt.named_parameters()})
    clipped = HeteroTrainer(model=MODEL, plan=plan(), train=dataclasses.replace(TRAIN, clip_grad=1.0),
                            batch_fn=batch_fn)
    clipped.strategy.staggered_step = True
    try:
        clipped.run(1)
        out["clip_error"] = None
    except ValueError as e:
        out["clip_error"] = str(e)
    return out


@pytest.mark.multiproc
@pytest.mark.slow  # about 50 s: three 4-rank trainers on 2 shared cores
def test_staggered_step_equals_the_synchronous_step():
    results = run_local(4, worker, timeout_s=300)
    for rank, out in enumerate(results):
        sync_losses, sync_params = out[False]
        stag_losses, stag_params = out[True]
        assert len(sync_losses) == 3 and sync_losses[0] != sync_losses[2]  # it trained
        for a, b in zip(stag_losses, sync_losses):
            assert abs(a - b) <= 1e-6 * abs(b), (rank, stag_losses, sync_losses)
        for name, p in sync_params.items():
            torch.testing.assert_close(stag_params[name], p, rtol=1e-6, atol=1e-7, msg=f"rank {rank} {name}")
        assert "--clip-grad" in out["clip_error"] and "use --clip-grad 0" in out["clip_error"]
