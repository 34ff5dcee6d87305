"""``runtime/holdings.plan_holdings`` (every rank's holdings from the plan, without processes) equals,
element for element and in order, what the gradient synchronizers of a real 6-rank gloo launch
all-gather (``GradientSynchronizer.all_holdings``), for plans of mixed TP sizes:

* ``sp_mixed_tp_tied``: replica A TP 2 -> TP 1, replica B TP 1 -> TP 2, sequence parallelism (the
  norms' ``sequence_parallel`` flags), tied word embedding held at TP 2 and 1 by first and last stages;
* ``gated_untied``: the same layout with a SwiGLU model (``glu`` fc1 shards) and an untied output layer;
* ``tp3d221_tp2_sp``: a [2,2,1] 3D stage (``grid`` holdings) before a sequence-parallel TP 2 stage.

One spawn builds each plan's stages (no training step: only construction); ~30 s.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_het.cluster import ModelSpec
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import run_local
from megatron_het.runtime.grad_sync import Holding
from megatron_het.runtime.holdings import plan_holdings
from megatron_het.train.config import TrainConfig

from workers.holdings_workers import gathered_holdings_worker

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=200)
GATED = dataclasses.replace(MODEL, swiglu=True, untie_embeddings_and_output_weights=True)
TRAIN = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=1, lr=1e-3)


def _stage(ranks, layers, grid=None) -> StagePlan:
    return StagePlan(island="cpu", device_type="CPU", ranks=tuple(ranks), layers=layers, tp_grid=grid)


def _plan(*replicas, sequence_parallel=False) -> Plan:
    return Plan(replicas=tuple(ReplicaPlan(stages=s, num_micro_batches=m) for s, m in replicas),
                micro_batch_size=2, global_batch_size=8, sequence_parallel=sequence_parallel)


MIXED = ((_stage([0, 1], (0, 2)), _stage([2], (2, 4))), 2), ((_stage([3], (0, 1)), _stage([4, 5], (1, 4))), 2)
CASES = [
    ("sp_mixed_tp_tied", MODEL, _plan(*MIXED, sequence_parallel=True)),
    ("gated_untied", GATED, _plan(*MIXED)),
    ("tp3d221_tp2_sp", MODEL, _plan(((_stage(range(4), (0, 2), (2, 2, 1)), _stage([4, 5], (2, 4))), 4),
                                    sequence_parallel=True)),
]


def first_difference(pure: list[Holding], real: list[Holding]) -> str | None:
    """None when equal; else the first position where they differ, and both holdings there."""
    for i, (a, b) in enumerate(zip(pure, real)):
        if a != b:
            return f"holding {i}: plan_holdings {a}, gathered {b}"
    if len(pure) != len(real):
        return f"plan_holdings gives {len(pure)} holdings, the ranks gathered {len(real)}"
    return None


@pytest.fixture(scope="module")
def per_rank():
    return run_local(6, gathered_holdings_worker, (CASES, TRAIN), timeout_s=600)


@pytest.mark.multiproc
@pytest.mark.parametrize("name, model, plan", CASES, ids=[c[0] for c in CASES])
def test_plan_holdings_equal_what_the_ranks_gather(per_rank, name, model, plan):
    real = per_rank[0][name]["gathered"]
    assert all(out[name]["gathered"] == real for out in per_rank)  # one gather, seen alike by every rank
    assert [h for out in per_rank for h in out[name]["own"]] == real  # HeteroTrainer.holdings(), rank order
    pure = plan_holdings(plan, model)
    assert first_difference(pure, real) is None, first_difference(pure, real)
    # what the plans were meant to exercise is in the gathered holdings
    flags = {"sp": any(h.sequence_parallel for h in real), "glu": any(h.glu for h in real),
             "grid": any(h.grid is not None for h in real), "tp_sizes": {h.tp_size for h in real}}
    assert flags == {"sp_mixed_tp_tied": {"sp": True, "glu": False, "grid": False, "tp_sizes": {1, 2}},
                     "gated_untied": {"sp": False, "glu": True, "grid": False, "tp_sizes": {1, 2}},
                     "tp3d221_tp2_sp": {"sp": True, "glu": False, "grid": True, "tp_sizes": {4, 2}}}[name]


def test_first_difference_names_a_wrong_tp_rank_and_a_missing_parameter():
    """The comparison fails on what a wrong ``plan_holdings`` would give (pure, no processes)."""
    real = plan_holdings(CASES[0][2], MODEL)
    wrong_rank = [dataclasses.replace(h, tp_rank=1 - h.tp_rank) if h.rank == 0 and h.partition_dim is not None else h
                  for h in real]
    assert first_difference(wrong_rank, real).startswith("holding 0: plan_holdings Holding(name='embedding.word_")
    missing = [h for h in real if not (h.rank == 5 and h.name == "decoder.final_layernorm.weight")]
    assert first_difference(missing, real) is not None
    assert first_difference(real, real) is None
