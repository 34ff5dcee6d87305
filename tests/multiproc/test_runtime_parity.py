"""Heterogeneous plans train exactly like one process (issue: runtime parity).

One 8-process spawn runs the named plans one after another, each from the same initial weights
as a single-process megatron-core reference; every iteration's loss must match within 1e-5
relative (fp32) and the final parameters within 1e-4 absolute (Adam's first steps amplify
round-off; the max difference is printed).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_het.checkpoint.full_state import assemble_full_state
from megatron_het.model.groups import BlockShape
from megatron_het.platform.local_launch import run_local
from megatron_het.train.config import TrainConfig

from support.param_diff import assert_losses_match, assert_seeded_start, reported_losses
from support.parity_plans import (
    BRIDGED,
    BRIDGED_CLUSTER,
    CASES,
    CROSS_VENDOR_BOUNDARIES,
    GLOBAL_BATCH_SIZE,
    HOMOGENEOUS,
    MICRO_BATCH_SIZE,
    MODEL,
    PADDED_VOCAB,
    plan,
    stage,
)
from workers.megatron_workers import hetero_cases_worker, megatron_block_worker

# Megatron's block recomputation (StagePlan.recompute_num_layers): replica 0's first stage recomputes
# the first 2 of its 3 layers, its last stage every layer; replica 1 (TP4, all 4 layers) only layer 0.
PARTIAL_RECOMPUTE = plan(([replace(stage([0, 1], (0, 3)), recompute=True, recompute_num_layers=2),
                           replace(stage([2, 3], (3, 4)), recompute=True)], 2),
                         ([replace(stage([4, 5, 6, 7], (0, 4)), recompute=True, recompute_num_layers=1)], 2))

TRAIN = TrainConfig(micro_batch_size=MICRO_BATCH_SIZE, global_batch_size=GLOBAL_BATCH_SIZE, train_iters=5, lr=1e-3)


@pytest.fixture(scope="module")
def runs():
    ref = run_local(1, megatron_block_worker, (MODEL, TRAIN, BlockShape(tp=1, pp=1, dp=1), None, PADDED_VOCAB))[0]
    assert_seeded_start(ref.initial_shards, model=MODEL, seed=TRAIN.seed, padded_vocab=PADDED_VOCAB)
    init = None  # every plan starts from the seed alone, as a user's fresh run (#34)
    cases = list(CASES.items()) + [("partial_recompute", PARTIAL_RECOMPUTE), ("bridged_nv_amd", BRIDGED, BRIDGED_CLUSTER),
                                   ("cross_vendor_boundaries", CROSS_VENDOR_BOUNDARIES, BRIDGED_CLUSTER),
                                   ("homogeneous_runtime", HOMOGENEOUS),
                                   ("homogeneous_megatron", BlockShape(tp=2, pp=2, dp=2))]
    per_rank = run_local(8, hetero_cases_worker, (MODEL, cases, TRAIN, init, PADDED_VOCAB))
    return ref, per_rank


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(CASES) + ["partial_recompute", "bridged_nv_amd", "cross_vendor_boundaries", "homogeneous_runtime",
                                                 "homogeneous_megatron"])
def test_plan_matches_single_process(runs, name):
    ref, per_rank = runs
    ref_losses = [log.lm_loss for log in ref.iterations]
    assert_losses_match(name, reported_losses(per_rank, name), ref_losses, TRAIN.train_iters)
    final = assemble_full_state([out[name][0].shards for out in per_rank if out[name][0].shards])
    ref_final = assemble_full_state([ref.shards])
    assert set(final) == set(ref_final), set(final) ^ set(ref_final)
    diffs = {k: float((final[k] - ref_final[k]).abs().max()) for k in ref_final}
    worst = max(diffs, key=diffs.get)
    print(f"{name}: max |param diff| {diffs[worst]:.2e} at {worst}; "
          f"time {max(out[name][1] for out in per_rank):.1f} s")
    assert diffs[worst] < 1e-4, f"{name}: {worst} differs by {diffs[worst]}"


@pytest.mark.multiproc
def test_homogeneous_runtime_equals_plain_megatron(runs):
    _, per_rank = runs
    ours, theirs = reported_losses(per_rank, "homogeneous_runtime"), reported_losses(per_rank, "homogeneous_megatron")
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 1e-5 * abs(b)


@pytest.mark.multiproc
def test_cross_vendor_gradient_groups_use_the_bridge(runs):
    _, per_rank = runs
    bridged = [kind for out in per_rank for _, kind in out["bridged_nv_amd"][0].routes]
    assert bridged and set(bridged) == {"het-bridge"}, bridged
    same_vendor = [kind for out in per_rank for _, kind in out["pp2tp2x3_pp1tp4x1"][0].routes]
    assert same_vendor and set(same_vendor) == {"native"}


@pytest.mark.multiproc
def test_cross_vendor_boundaries_go_through_the_bridge(runs):
    """Asserted from the start-up log (rank 0 states each group kind's path) and the bridge's counters."""
    _, per_rank = runs
    comm = [out[("comm", "cross_vendor_boundaries")] for out in per_rank]
    line = next(line for line in comm[0]["log"] if line.startswith("communication paths:"))
    print(line)
    assert "pipeline boundaries: 0 native (gloo), 2 het-bridge" in line, line
    assert "stage (TP) groups: 4 native (gloo), 0 het-bridge" in line, line
    assert comm[0]["paths"]["gradient groups"]["het-bridge"] > 0
    for rank, c in enumerate(comm):  # every rank sent activations or gradients across the bridge
        assert c["boundary_bridge_bytes"] > 0, f"rank {rank}: no bytes through the boundary bridge"
        assert "het-bridge" in c["gradient_routes"], (rank, c["gradient_routes"])  # the tied embedding spans vendors
    same_vendor = per_rank[0][("comm", "pp2tp2x3_pp1tp4x1")]["paths"]
    assert all(c["het-bridge"] == 0 for c in same_vendor.values()), same_vendor


@pytest.mark.multiproc
def test_block_recompute_reruns_only_the_first_layers(runs):
    """The layers a plan's recompute_num_layers names run their forward twice per micro-batch (once
    more in the backward), the others once: megatron-core's block method, per stage."""
    _, per_rank = runs
    micro = 2 * TRAIN.train_iters  # every replica of PARTIAL_RECOMPUTE has 2 micro-batches
    expected = {0: [2, 2, 1], 1: [2, 2, 1], 2: [2], 3: [2], 4: [2, 1, 1, 1], 5: [2, 1, 1, 1], 6: [2, 1, 1, 1],
                7: [2, 1, 1, 1]}
    for rank, per_layer in expected.items():
        assert per_rank[rank][("layer_calls", "partial_recompute")] == [micro * k for k in per_layer], rank
