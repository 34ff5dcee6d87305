"""The schedules the planner prices run as priced (#16): interleaved 1F1B and ZB-H1 train exactly like one process.

One 6-process spawn runs each plan of support/schedule_plans.py for 3 iterations, saves a checkpoint,
resumes it in a new trainer and runs 2 more; the 5 losses must match the single-process megatron-core
reference within 1e-5 relative (fp32) and the final parameters within 1e-4 absolute (the bound of the
other parity tests: Adam's first steps amplify round-off; the worst difference is printed). The run
must also be what the plan says: model chunks and per-chunk actions for interleaved, W actions that
computed the linears' weight gradients for ZB-H1.

Also printed, per tensor: ||p - p_ref||_2 / ||p_ref||_2 (support/param_diff.relative_norms, float64
norms over the whole tensor). Measured 2026-11-25: at most 7.9e-5 (ZB-H1), 9.8e-5 and 1.5e-4
(interleaved), in 8-12 of 76 tensors above 1e-5, all of them biases and norm biases (small norms: they
start at 0 or 1); the weight matrices at most 0.9e-5..2.1e-5. That is fp32 round-off, not a schedule
error: the single-process reference against itself with micro-batches of 1 instead of 2 (the same
samples, another summation grouping) differs by up to 5.5e-5 in the same way (10 of 76 tensors above
1e-5, the qkv biases). Issue #16's "relative <= 1e-5 on final parameters" is therefore asserted with all
parameters as one vector (||p - p_ref|| / ||p_ref|| over all of them: 5.3e-7..8.5e-7 measured); per tensor
it is below this training's fp32 floor, and the absolute bound holds.

Whether the difference is round-off or a small bug is decided against a float64 truth (the reference's
training replayed in float64 in the reference's process, workers/f64_workers.py; its validation and the
criterion's in tests/multiproc/test_fp32_floor.py): each run must be as close to the truth as the fp32
reference is (support/param_diff.TruthComparison: over all parameters at most 4x the reference's distance,
per tensor at most 20x max(the reference's distance of that tensor, over all)). Measured 2026-11-29 from
the seed (`pytest -s`), over all parameters: reference 4.39e-7; interleaved uneven 1.16x, interleaved two
replicas 1.80x, ZB-H1 1.18x; per tensor at most 3.2x. With ATen's scalar kernels and with oneDNN at
SSE4.1 the ratios move to 0.94x..1.52x (per tensor 3.55x), and another machine measured 2.23x: the spread
support/param_diff.py's 4x covers. The runtime is as accurate as the single-process reference.
"""

from __future__ import annotations

import pytest

from megatron_het.checkpoint.full_state import assemble_full_state
from megatron_het.platform.local_launch import run_local
from megatron_het.runtime.executor import globalise
from megatron_het.runtime.hetero_trainer import replica_first_micro_batch
from megatron_het.schedule import build_schedule
from megatron_het.train.config import TrainConfig

from support.param_diff import assert_final_parameters, assert_seeded_start
from support.parity_plans import MICRO_BATCH_SIZE
from support.schedule_plans import GLOBAL_BATCH_SIZE6, MODEL6, PADDED_VOCAB6, SCHEDULE_CASES
from workers.f64_workers import reference_and_truth_worker
from workers.schedule_workers import schedule_cases_worker

TRAIN = TrainConfig(micro_batch_size=MICRO_BATCH_SIZE, global_batch_size=GLOBAL_BATCH_SIZE6, train_iters=5, lr=1e-3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ref, truths = run_local(1, reference_and_truth_worker, (MODEL6, TRAIN, PADDED_VOCAB6))[0]
    assert_seeded_start(ref.initial_shards, model=MODEL6, seed=TRAIN.seed, padded_vocab=PADDED_VOCAB6)
    init = None  # every plan starts from the seed alone, as a user's fresh run (#34)
    save = str(tmp_path_factory.mktemp("ckpt"))
    per_rank = run_local(6, schedule_cases_worker, (MODEL6, list(SCHEDULE_CASES.items()), TRAIN, init, PADDED_VOCAB6,
                                                   save, 3))
    return ref, truths["truth"].final, per_rank


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(SCHEDULE_CASES))
def test_schedule_matches_single_process_through_a_checkpoint(runs, name):
    ref, truth, per_rank = runs
    ref_losses = [log.lm_loss for log in ref.iterations]
    logs = per_rank[-1][name][0]  # the last rank is a last stage in every case: it reports losses
    assert [log.iteration for log in logs] == [1, 2, 3, 4, 5]
    for i, (log, want) in enumerate(zip(logs, ref_losses)):
        assert abs(log.lm_loss - want) <= 1e-5 * abs(want), f"{name} iteration {i + 1}: {log.lm_loss} vs {want}"
    final = assemble_full_state([out[name][1] for out in per_rank if out[name][1]])
    ref_final = assemble_full_state([ref.shards])
    assert_final_parameters(name, final, ref_final, truth)

    plan = SCHEDULE_CASES[name]
    for out in per_rank:
        ran = out[name][2]
        ri, si = ran["role"]  # what ran is what the simulator prices: the plan's build_schedule lists
        rep = plan.replicas[ri]
        want = build_schedule(plan.schedule, len(rep.stages), rep.num_micro_batches, plan.virtual_pipeline_size)
        assert ran["actions"] == [str(a) for a in globalise(want.actions[si], replica_first_micro_batch(plan, ri))]
        if plan.schedule == "interleaved":
            assert ran["models"] == 2 and ran["chunks"] == [0, 1], ran
        else:
            assert ran["w_actions"] > 0 and ran["linears_deferred"] > 0, ran  # W computed the linears' dW
