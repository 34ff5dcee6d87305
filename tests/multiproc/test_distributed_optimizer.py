"""The distributed optimizer (--use-distributed-optimizer) trains exactly like one process.

One 8-process spawn runs, from the same initial weights as a single-process megatron-core run,
the plain runtime and the distributed optimizer on: (homogeneous) TP2xPP2 x 2 replicas, (b) two
replicas of different TP sizes (PP2xTP2 / PP1xTP4) (also with --overlap-param-gather), and (bridged) the same layout on an emulated
A100-80GB + MI250X cluster, where shards are uneven (proportional to each rank's free memory) and
the collectives go through the het bridge. Each of 3 losses within 1e-5 relative of the
single-process run (the last two with small gradient buckets: many buckets per group), final parameters within 1e-4 of the plain runtime's (fp32; the runtime parity
test's tolerances);
optimizer state per rank at most 1/n + 2% of the plain run's (every parameter is held n >= 2 times).
A second spawn saves with the distributed optimizer, resumes without it, saves, and resumes with
it: losses equal an uninterrupted run.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_het.checkpoint.full_state import assemble_full_state
from megatron_het.model.groups import BlockShape
from megatron_het.optim.holders import plan_shard_buckets
from megatron_het.perf.memory import optimizer_shard_weights
from megatron_het.platform.local_launch import run_local
from megatron_het.train.config import TrainConfig

from support.parity_plans import (
    BRIDGED,
    BRIDGED_CLUSTER,
    CASES,
    GLOBAL_BATCH_SIZE,
    HOMOGENEOUS,
    MICRO_BATCH_SIZE,
    MODEL,
    PADDED_VOCAB,
)
from workers.dist_opt_workers import dist_opt_cases_worker, dist_opt_checkpoint_worker
from workers.megatron_workers import megatron_block_worker

TRAIN = TrainConfig(micro_batch_size=MICRO_BATCH_SIZE, global_batch_size=GLOBAL_BATCH_SIZE, train_iters=3, lr=1e-3)


def _on(plan, on=True):
    return dataclasses.replace(plan, use_distributed_optimizer=on)


BUCKET = 3000  # --ddp-bucket-size below most parameters' size: about one bucket per parameter (many buckets per group)
DIST_CASES = {"homogeneous": (_on(HOMOGENEOUS), None, None),
              # with --overlap-param-gather: the gathers finish in the next forward's pre-hooks
              "different_tp_overlap_param_gather": (_on(CASES["pp2tp2x3_pp1tp4x1"]), None,
                                                    {"overlap_param_gather": True, "ddp_bucket_size": BUCKET}),
              "uneven_bridged": (_on(BRIDGED), BRIDGED_CLUSTER, {"ddp_bucket_size": BUCKET})}
RESUME_ITERS = 6  # the checkpoint test's uninterrupted run (constant learning rate: its first 3 losses
# are the parity cases' reference too, so one single-process run serves both)


@pytest.fixture(scope="module")
def reference():
    train = dataclasses.replace(TRAIN, train_iters=RESUME_ITERS)
    ref = run_local(1, megatron_block_worker, (MODEL, train, BlockShape(tp=1, pp=1, dp=1), None, PADDED_VOCAB))[0]
    return ref, assemble_full_state([ref.initial_shards])


@pytest.fixture(scope="module")
def runs(reference):
    ref, init = reference
    cases = [("plain_homogeneous", HOMOGENEOUS, None, None)] + [(n, *case) for n, case in DIST_CASES.items()]
    per_rank = run_local(8, dist_opt_cases_worker, (MODEL, cases, TRAIN, init, PADDED_VOCAB))
    return ref, per_rank


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(DIST_CASES))
def test_distributed_optimizer_matches_single_process(runs, name):
    ref, per_rank = runs
    expected = [log.lm_loss for log in ref.iterations][:TRAIN.train_iters]
    losses = [log.lm_loss for log in per_rank[0][name][0].iterations]
    assert len(losses) == TRAIN.train_iters
    for i, (a, b) in enumerate(zip(losses, expected)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{name} iteration {i + 1}: {a} vs single-process {b}"
    # parameters against the plain runtime's (torch AdamW on full state; itself held to one process
    # by test_runtime_parity), same plan family, same 3 steps
    final = assemble_full_state([out[name][0].shards for out in per_rank if out[name][0].shards])
    ref_final = assemble_full_state([out["plain_homogeneous"][0].shards for out in per_rank
                                     if out["plain_homogeneous"][0].shards])
    diffs = {k: float((final[k] - ref_final[k]).abs().max()) for k in ref_final}
    worst = max(diffs, key=diffs.get)
    print(f"{name}: max |param diff| {diffs[worst]:.2e} at {worst}")
    assert diffs[worst] < 1e-4, f"{name}: {worst} differs by {diffs[worst]}"


@pytest.mark.slow
@pytest.mark.multiproc
def test_optimizer_state_is_one_nth_per_rank(runs):
    _, per_rank = runs
    for rank, out in enumerate(per_rank):
        plain, dist = out["plain_homogeneous"][1].optimizer_bytes, out["homogeneous"][1].optimizer_bytes
        print(f"rank {rank}: optimizer state {dist} B distributed vs {plain} B plain ({dist / plain:.3f})")
        assert dist <= (1 / 2 + 0.02) * plain, f"rank {rank}: {dist} > (1/2 + 2%) x {plain}"
        assert out["homogeneous"][1].parameters_bytes == out["plain_homogeneous"][1].parameters_bytes


def test_bridged_plan_has_uneven_shards():
    """The A100-80GB and MI250X ranks have different free memory, so a full tensor held by both
    replicas is split unevenly (this is the 'uneven shards' plan of the parity test)."""
    weights = optimizer_shard_weights(MODEL, BRIDGED, precision="fp32")
    assert weights[0] != weights[4]
    from megatron_het.runtime.grad_sync import Holding

    hs = [Holding(name="w", rank=r, stage_key=(0 if r < 4 else 1, 0), tp_rank=r % 4 if r >= 4 else r % 2,
                  tp_size=4 if r >= 4 else 2, partition_dim=0, full_shape=(64, 8)) for r in (0, 1, 4, 5, 6, 7)]
    (bucket,) = plan_shard_buckets(hs, weights=weights)
    sizes = dict(zip(bucket.ranks, bucket.sizes()))
    assert sizes[0] != 2 * sizes[4], sizes  # equal weights would give TP2 ranks 2x a TP4 rank's share


@pytest.mark.slow
@pytest.mark.multiproc
def test_save_with_distributed_optimizer_resume_without_and_back(reference, tmp_path):
    ref, init = reference
    train = dataclasses.replace(TRAIN, train_iters=RESUME_ITERS)
    save = str(tmp_path / "ckpt")
    different_tp = CASES["pp2tp2x3_pp1tp4x1"]
    steps = [(_on(HOMOGENEOUS), 2, None, True),  # distributed optimizer, save at 2
             (_on(different_tp, False), 2, 2, True),  # resume without it under another plan, save at 4
             (_on(different_tp), 2, 4, False)]  # resume with it again
    per_rank = run_local(8, dist_opt_checkpoint_worker, (MODEL, steps, train, init, PADDED_VOCAB, save))
    resumed = [x for seg in per_rank[0] for x in seg]
    expected = [log.lm_loss for log in ref.iterations]
    assert len(resumed) == 6
    for i, (a, b) in enumerate(zip(resumed, expected)):
        assert abs(a - b) <= 1e-5 * abs(b), f"iteration {i + 1}: resumed {a} vs uninterrupted {b}"
