"""Checkpoints written under one plan load under any other and resume exactly.

Save under plan (a) (TP 2 -> 4 -> 2), load under (b) (two replicas PP2xTP2 / PP1xTP4), save again,
load under a homogeneous TP2xPP2xDP2 plan: every loss of the 6 iterations equals an uninterrupted
single-process run (relative 1e-5, fp32). Also: another model's checkpoint is refused by field, and
an interrupted save leaves the tracker on the last complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from megatron_het.checkpoint.dist_ckpt import (
    CheckpointError,
    check_model_matches,
    latest_iteration,
    model_common_state,
)
from megatron_het.checkpoint.full_state import assemble_full_state
from megatron_het.model.groups import BlockShape
from megatron_het.platform.local_launch import run_local
from megatron_het.train.config import TrainConfig

from support.parity_plans import CASES, GLOBAL_BATCH_SIZE, HOMOGENEOUS, MICRO_BATCH_SIZE, MODEL, PADDED_VOCAB
from workers.megatron_workers import checkpoint_worker, megatron_block_worker

TRAIN = TrainConfig(micro_batch_size=MICRO_BATCH_SIZE, global_batch_size=GLOBAL_BATCH_SIZE, train_iters=5, lr=1e-3)


@pytest.mark.multiproc
def test_save_under_one_plan_resume_under_others(tmp_path):
    train = dataclasses.replace(TRAIN, train_iters=6)
    ref = run_local(1, megatron_block_worker, (MODEL, train, BlockShape(tp=1, pp=1, dp=1), None, PADDED_VOCAB))[0]
    init = assemble_full_state([ref.initial_shards])
    save = str(tmp_path / "ckpt")
    steps = [(CASES["tp2pp1_tp4pp1_tp2pp1"], 2, None, True),
             (CASES["pp2tp2x3_pp1tp4x1"], 2, 2, True),
             (HOMOGENEOUS, 2, 4, False)]
    per_rank = run_local(8, checkpoint_worker, (MODEL, steps, train, init, PADDED_VOCAB, save))
    resumed = [log.lm_loss for seg in per_rank[0] for log in seg.iterations]
    expected = [log.lm_loss for log in ref.iterations]
    assert [log.iteration for seg in per_rank[0] for log in seg.iterations] == [1, 2, 3, 4, 5, 6]
    for i, (a, b) in enumerate(zip(resumed, expected)):
        assert abs(a - b) <= 1e-5 * abs(b), f"iteration {i + 1}: resumed {a} vs uninterrupted {b}"
    assert latest_iteration(save) == 4
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]


def test_checkpoint_of_another_model_is_refused_naming_the_field():
    common = {"model": model_common_state(MODEL)}
    other = dataclasses.replace(MODEL, hidden_size=128)
    with pytest.raises(CheckpointError, match=r"model\.hidden_size.*hidden_size=64.*hidden_size=128"):
        check_model_matches(common, other, "ckpt/iter_0000002")
    check_model_matches(common, MODEL, "ckpt/iter_0000002")  # same model: accepted


def test_tracker_errors_and_absence(tmp_path):
    assert latest_iteration(str(tmp_path)) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release\n")
    with pytest.raises(CheckpointError, match="expected an iteration number.*'release'"):
        latest_iteration(str(tmp_path))
