"""Without an initial state, every copy of a parameter starts equal: replicas with other layer
splits or TP sizes, and the last stage's copy of a tied word embedding (megatron-core leaves it to
an all-reduce at start-up; a stage seeded on its own would otherwise train a different embedding)."""

import pytest

from megatron_het.cluster import ModelSpec
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import run_local
from megatron_het.train.config import TrainConfig

MODEL = ModelSpec(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100)


def _s(ranks, layers):
    return StagePlan(island="cpu", device_type="CPU", ranks=ranks, layers=layers)


# replica 0: PP2 (TP1 -> TP2), replica 1: one TP1 stage with all layers
PLAN = Plan(replicas=(ReplicaPlan(stages=(_s((0,), (0, 2)), _s((1, 2), (2, 4))), num_micro_batches=1),
                      ReplicaPlan(stages=(_s((3,), (0, 4)),), num_micro_batches=1)),
            micro_batch_size=2, global_batch_size=4)


def _rank(rank, world_size):
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    enable_cpu_backend()
    train = TrainConfig(micro_batch_size=2, global_batch_size=4, train_iters=1)
    trainer = HeteroTrainer(model=MODEL, plan=PLAN, train=train, batch_fn=lambda it, idx: None)
    stage = trainer.strategy
    return {name: (p.detach().clone(), stage.sync.local[name]) for name, p in stage.params.items()}


@pytest.mark.multiproc
def test_every_copy_starts_from_the_owners_values():
    from megatron_het.checkpoint.tp_layout import slice_full

    per_rank = run_local(4, _rank, timeout_s=600)
    full = per_rank[3]  # replica 1 holds every tensor whole (TP1, all layers, tied embedding once)
    checked = 0
    for rank in (0, 1, 2):
        for name, (value, h) in per_rank[rank].items():
            ref = full[name][0]
            if h.partition_dim is not None:
                ref = slice_full(ref, h.partition_dim, h.tp_rank, h.tp_size, h.glu)
            assert value.shape == ref.shape, name
            assert (value == ref).all(), f"rank {rank} {name} differs from replica 1's copy"
            checked += 1
    # the tied embedding's last-stage copy (ranks 1, 2: vocab-parallel halves) is among them
    assert "embedding.word_embeddings.weight" in per_rank[1] and checked > 20
