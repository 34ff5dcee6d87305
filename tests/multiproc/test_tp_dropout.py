"""Tensor-parallel peers draw the same hidden-dropout masks (#35): the hidden states after a layer
are replicated on every TP rank, so the dropout applied to them must be the same on every rank, or
the ranks' copies diverge silently (the next layer's column-parallel input would differ per rank).

A TP2 stage with --hidden-dropout 0.2 --attention-dropout 0.2, one iteration of two micro-batches:
the decoder's output must be bit-identical on both ranks (Megatron-LM seeds the default generator
alike on TP peers and gives attention dropout, over each rank's own heads, the model-parallel RNG
tracker's per-rank stream), and must differ from the same run without dropout (dropout is on). ~15 s."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_het.cluster import ModelSpec
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import run_local
from megatron_het.train.config import TrainConfig

from workers.megatron_workers import decoder_outputs_worker

MODEL = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256,
                  hidden_dropout=0.2, attention_dropout=0.2)
TRAIN = TrainConfig(micro_batch_size=2, global_batch_size=4, train_iters=1, lr=1e-3)
PLAN = Plan(replicas=(ReplicaPlan(stages=(StagePlan(island="cpu", device_type="CPU", ranks=(0, 1), layers=(0, 2)),),
                                  num_micro_batches=2),), micro_batch_size=2, global_batch_size=4)


@pytest.mark.multiproc
def test_tp_peers_share_hidden_dropout_masks():
    models = {"dropout": MODEL, "none": dataclasses.replace(MODEL, hidden_dropout=0.0, attention_dropout=0.0)}
    per_rank = run_local(2, decoder_outputs_worker, (models, PLAN, TRAIN))
    for name in models:
        a, b = per_rank[0][name], per_rank[1][name]
        assert len(a) == len(b) == 2  # one forward per micro-batch
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"{name}: TP ranks' decoder outputs differ by {(x - y).abs().max():.3g}"
    for x, y in zip(per_rank[0]["dropout"], per_rank[0]["none"]):
        assert not torch.allclose(x, y), "dropout changed nothing: the test would pass without it"
