"""Mixture-of-experts plans train exactly like one process (#37): experts replicated per replica, and
spread by expert parallelism over a stage's ranks, over replicas, or both.

For each MoE model (tests/support/moe_plans.py) a single-process megatron-core reference (its own
schedule, which sets the auxiliary losses' gradient scale itself) and one 4-process spawn running
every plan from the same seed; every iteration's loss must match within 1e-5 relative (fp32) and the
final parameters within 1e-4 absolute, as the dense parity suite. The router's auxiliary losses must
weigh what they weigh in one process: scaled by the replica's micro-batches instead of the global
batch's, the routers' weights move 6e-3 apart in four steps (measured), far outside the tolerance.
"""

from __future__ import annotations

import pytest

from megatron_het.checkpoint.full_state import assemble_full_state
from megatron_het.model.groups import BlockShape
from megatron_het.platform.local_launch import run_local
from megatron_het.train.config import TrainConfig

from support.moe_plans import CASES, MODELS
from support.param_diff import assert_losses_match, reported_losses
from support.parity_plans import GLOBAL_BATCH_SIZE, MICRO_BATCH_SIZE, PADDED_VOCAB
from workers.megatron_workers import checkpoint_worker, hetero_cases_worker, megatron_block_worker

TRAIN = TrainConfig(micro_batch_size=MICRO_BATCH_SIZE, global_batch_size=GLOBAL_BATCH_SIZE, train_iters=4, lr=1e-3)


_RUNS: dict[str, tuple] = {}  # model name -> (reference, per-rank results): one spawn per model


def runs(model_name: str):
    if model_name not in _RUNS:
        model, names = MODELS[model_name]
        ref = run_local(1, megatron_block_worker, (model, TRAIN, BlockShape(tp=1, pp=1, dp=1), None, PADDED_VOCAB))[0]
        per_rank = run_local(4, hetero_cases_worker, (model, [(n, CASES[n]) for n in names], TRAIN, None,
                                                      PADDED_VOCAB))
        _RUNS[model_name] = ref, per_rank
    return _RUNS[model_name]


@pytest.mark.multiproc
@pytest.mark.parametrize("model_name,name", [(m, n) for m, (_, names) in MODELS.items() for n in names])
def test_moe_plan_matches_single_process(model_name, name):
    ref, per_rank = runs(model_name)
    ref_losses = [log.lm_loss for log in ref.iterations]
    assert_losses_match(name, reported_losses(per_rank, name), ref_losses, TRAIN.train_iters)
    final = assemble_full_state([out[name][0].shards for out in per_rank if out[name][0].shards])
    ref_final = assemble_full_state([ref.shards])
    assert set(final) == set(ref_final), set(final) ^ set(ref_final)
    assert any(".mlp.experts.local_experts." in k for k in final) and any(".mlp.router." in k for k in final)
    worst = max(((final[k] - ref_final[k]).abs().max().item(), k) for k in final)
    assert worst[0] <= 1e-4, f"{name}: {worst[1]} differs by {worst[0]:.3e} from the single-process model"


@pytest.mark.multiproc
@pytest.mark.parametrize("model_name", list(MODELS))
def test_moe_losses_are_logged(model_name):
    """Every iteration reports the routers' losses the model records (mean per MoE layer and micro-batch):
    the same on every rank, positive, and identical across plans of the same model (they are functions of
    the weights and the batch, both equal under every plan)."""
    _, per_rank = runs(model_name)
    seen = {}
    for name in MODELS[model_name][1]:
        for rank_out in per_rank:
            logs = rank_out[name][0].iterations
            values = [log.moe_losses for log in logs]
            assert all(v for v in values), f"{name}: no MoE losses logged"
            seen.setdefault(name, values)
            assert values == seen[name], f"{name}: ranks disagree on the MoE losses"
    first, *others = seen.values()
    for other in others:
        for a, b in zip(first, other):
            assert a.keys() == b.keys()
            for k in a:
                assert a[k] > 0 and abs(a[k] - b[k]) <= 1e-5 * a[k], (k, a[k], b[k])


@pytest.mark.multiproc
def test_moe_checkpoint_resumes_under_other_plans(tmp_path):
    """Saved with experts spread over a stage's TP ranks (EP2 in TP2 stages), resumed with them over two
    replicas (EP2 over PP2 replicas), saved, resumed with every expert on every replica (TP2 -> TP1 beside
    a TP1 replica, distributed optimizer): the 6 losses equal an uninterrupted single-process run.
    Experts are named by global layer and global expert index, so any placement reads any other's."""
    import dataclasses

    from megatron_het.checkpoint.dist_ckpt import CheckpointError, check_model_matches, model_common_state

    model = MODELS["mixtral_like"][0]
    train = dataclasses.replace(TRAIN, train_iters=6)
    ref = run_local(1, megatron_block_worker, (model, train, BlockShape(tp=1, pp=1, dp=1), None, PADDED_VOCAB))[0]
    save = str(tmp_path / "ckpt")
    steps = [(CASES["ep2_in_tp2_stages"], 2, None, True), (CASES["ep2_over_replicas"], 2, 2, True),
             (CASES["tp2_tp1_x3_tp1x1_distopt"], 2, 4, False)]
    per_rank = run_local(4, checkpoint_worker, (model, steps, train, None, PADDED_VOCAB, save))
    resumed = [log.lm_loss for seg in per_rank[-1] for log in seg.iterations]
    expected = [log.lm_loss for log in ref.iterations]
    assert len(resumed) == 6
    for i, (a, b) in enumerate(zip(resumed, expected)):
        assert abs(a - b) <= 1e-5 * abs(b), f"iteration {i + 1}: resumed {a} vs uninterrupted {b}"
    # a dense checkpoint (written before MoE existed: no MoE fields) is refused by an MoE run, naming the field
    dense = {k: v for k, v in model_common_state(model).items() if k != "num_experts" and not k.startswith("moe_")}
    with pytest.raises(CheckpointError, match=r"model\.num_experts: .*num_experts=None.*num_experts=4"):
        check_model_matches({"model": dense}, model, "ckpt/iter_0000002")


@pytest.mark.multiproc
def test_expert_biases_train_alike_under_three_placements():
    """Linear biases with experts: megatron-core trains them only with expert parallelism at expert-TP 1
    (at EP 1 its SequentialMLP fails, so there is no single-process reference). Three placements (EP2
    over replicas, EP4 over TP2 replicas, EP2 inside TP2 stages) train the same losses and weights."""
    import dataclasses

    model = dataclasses.replace(MODELS["mixtral_like"][0], add_bias_linear=True)
    names = ("ep2_over_replicas", "ep4_over_tp2_replicas", "ep2_in_tp2_stages")
    per_rank = run_local(4, hetero_cases_worker, (model, [(n, CASES[n]) for n in names], TRAIN, None, PADDED_VOCAB))
    first = names[0]
    want_losses = reported_losses(per_rank, first)
    want = assemble_full_state([out[first][0].shards for out in per_rank if out[first][0].shards])
    assert any(k.endswith("local_experts.3.linear_fc2.bias") for k in want)
    for name in names[1:]:
        assert reported_losses(per_rank, name) == pytest.approx(want_losses, rel=1e-5), name
        got = assemble_full_state([out[name][0].shards for out in per_rank if out[name][0].shards])
        assert set(got) == set(want)
        worst = max(((got[k] - want[k]).abs().max().item(), k) for k in got)
        assert worst[0] <= 1e-4, f"{name}: {worst[1]} differs by {worst[0]:.3e} from {first}"
