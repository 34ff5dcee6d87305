"""A Llama-style model (SwiGLU, GQA, rotary, untied) across stages and replicas of different TP sizes.

Gated-MLP weights are [gate_r; up_r] per TP rank, so the TP=1 and TP=2 holders of linear_fc1 can
only be reduced through the layout in checkpoint/tp_layout.py; losses must equal a single-process
run within 1e-5 relative (fp32).
"""

from __future__ import annotations

import pytest

from megatron_het.checkpoint.full_state import assemble_full_state
from megatron_het.cluster import ModelSpec
from megatron_het.model.groups import BlockShape
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import run_local
from megatron_het.train.config import TrainConfig

from support.param_diff import assert_seeded_start
from workers.megatron_workers import hetero_cases_worker, megatron_block_worker

LLAMA = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                  seq_length=32, vocab_size=200, swiglu=True, untie_embeddings_and_output_weights=True)
TRAIN = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=4, lr=1e-3)


def _s(ranks, layers):
    return StagePlan(island="cpu", device_type="CPU", ranks=tuple(ranks), layers=layers)


PLAN = Plan(replicas=(ReplicaPlan(stages=(_s([0], (0, 1)), _s([1, 2], (1, 4))), num_micro_batches=3),
                      ReplicaPlan(stages=(_s([3], (0, 4)),), num_micro_batches=1)),
            micro_batch_size=2, global_batch_size=8)


@pytest.mark.multiproc
def test_llama_style_mixed_tp_matches_single_process():
    ref = run_local(1, megatron_block_worker, (LLAMA, TRAIN, BlockShape(tp=1, pp=1, dp=1), None, 256))[0]
    assert_seeded_start(ref.initial_shards, model=LLAMA, seed=TRAIN.seed, padded_vocab=256)
    init = None  # the plan starts from the seed alone, as a user's fresh run (#34)
    out = run_local(4, hetero_cases_worker, (LLAMA, [("llama", PLAN)], TRAIN, init, 256))
    losses = [log.lm_loss for log in out[0]["llama"][0].iterations]
    expected = [log.lm_loss for log in ref.iterations]
    for i, (a, b) in enumerate(zip(losses, expected)):
        assert abs(a - b) <= 1e-5 * abs(b), f"iteration {i + 1}: {a} vs single-process {b}"
    final = assemble_full_state([o["llama"][0].shards for o in out])
    ref_final = assemble_full_state([ref.shards])
    worst = max(float((final[k] - ref_final[k]).abs().max()) for k in ref_final)
    assert worst < 1e-4, worst
