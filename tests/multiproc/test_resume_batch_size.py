"""Resuming with another global batch size continues where the data stopped (Megatron-LM's
consumed-samples count): 3 iterations of 8 samples saved, resumed at global batch 4 for 2 more
iterations on 2 gloo ranks: the resumed batches start at samples 24 and 28 (not 12 and 16), the
logged and the saved counts are 28 and 32."""

from __future__ import annotations

import pytest

from megatron_het.plan import Plan, ReplicaPlan
from megatron_het.platform.local_launch import run_local
from megatron_het.train.config import TrainConfig

from support.parity_plans import MODEL, PADDED_VOCAB, stage
from workers.resume_workers import resume_worker


@pytest.mark.multiproc
def test_resume_with_another_global_batch_size_continues_the_data(tmp_path):
    stages = [stage((0,), (0, 2)), stage((1,), (2, 4))]
    first = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=3, lr=1e-3)
    second = TrainConfig(micro_batch_size=2, global_batch_size=4, train_iters=5, lr=1e-3)
    steps = [(Plan(replicas=(ReplicaPlan(stages=tuple(stages), num_micro_batches=4),), micro_batch_size=2,
                   global_batch_size=8), first, False),
             (Plan(replicas=(ReplicaPlan(stages=tuple(stages), num_micro_batches=2),), micro_batch_size=2,
                   global_batch_size=4), second, True)]
    per_rank = run_local(2, resume_worker, (MODEL, steps, PADDED_VOCAB, str(tmp_path / "ckpt")))
    (firsts1, logged1, saved1), (firsts2, logged2, saved2) = per_rank[0]
    assert firsts1 == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22] and logged1 == [8, 16, 24] and saved1 == 24
    assert firsts2 == [24, 26, 28, 30]  # micro-batches of 2: iteration 4 reads 24..27, iteration 5 28..31
    assert logged2 == [28, 32] and saved2 == 32
    assert per_rank[1][1][:2] == (firsts2, logged2)  # the last stage reads the same labels
