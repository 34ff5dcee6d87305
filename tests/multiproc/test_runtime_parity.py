"""Heterogeneous plans train exactly like one process (issue: runtime parity).

One 8-process spawn runs the named plans one after another, each from the same initial weights
as a single-process megatron-core reference; every iteration's loss must match within 1e-5
relative (fp32) and the final parameters within 1e-4 absolute (Adam's first steps amplify
round-off; the max difference is printed).
"""

from __future__ import annotations

import pytest

from megatron_het.checkpoint.full_state import assemble_full_state
from megatron_het.cluster import ModelSpec
from megatron_het.model.groups import BlockShape
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import run_local
from megatron_het.train.config import TrainConfig

from workers.megatron_workers import hetero_cases_worker, megatron_block_worker

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=200)
TRAIN = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=5, lr=1e-3)
PADDED_VOCAB = 512  # 200 padded to a multiple of 128 x lcm(TP sizes = 1, 2, 4)


def stage(ranks, layers, island="fast"):
    return StagePlan(island=island, device_type="CPU", ranks=tuple(ranks), layers=layers)


def plan(*replicas):
    return Plan(replicas=tuple(ReplicaPlan(stages=tuple(s), num_micro_batches=m) for s, m in replicas),
                micro_batch_size=TRAIN.micro_batch_size, global_batch_size=TRAIN.global_batch_size)


CASES = {
    # (a) three stages, TP 2 -> 4 -> 2, uneven layers 1/2/1
    "tp2pp1_tp4pp1_tp2pp1": plan(([stage([0, 1], (0, 1)), stage([2, 3, 4, 5], (1, 3), "slow"),
                                   stage([6, 7], (3, 4))], 4)),
    # (b) two replicas of different layouts (PP2xTP2 vs PP1xTP4) with 3 vs 1 micro-batches
    "pp2tp2x3_pp1tp4x1": plan(([stage([0, 1], (0, 3)), stage([2, 3], (3, 4))], 3),
                              ([stage([4, 5, 6, 7], (0, 4), "slow")], 1)),
    # (c) TP 1 -> 2 boundaries with tied embeddings (first stage TP1, last TP2), three replicas
    "tp1_tp2_tied_x3": plan(([stage([0], (0, 2)), stage([1, 2], (2, 4))], 2),
                            ([stage([3], (0, 1)), stage([4, 5], (1, 4))], 1),
                            ([stage([6], (0, 3)), stage([7], (3, 4))], 1)),
}
# (b) again on an emulated A100 + MI250X cluster: every cross-replica gradient group spans NCCL and
# RCCL islands, so it must go through megatron_het.comm's bridge (gloo underneath, here)
BRIDGED_CLUSTER = {
    "islands": [{"name": "nv", "device": "A100-80GB", "nodes": 1, "gpus_per_node": 4},
                {"name": "amd", "device": "MI250X", "nodes": 1, "gpus_per_node": 4}],
    "links": [{"between": ["nv", "amd"], "bandwidth_gbps": 100}],
}
BRIDGED = Plan(replicas=(
    ReplicaPlan(stages=(StagePlan(island="nv", device_type="A100-80GB", ranks=(0, 1), layers=(0, 3)),
                        StagePlan(island="nv", device_type="A100-80GB", ranks=(2, 3), layers=(3, 4))),
                num_micro_batches=3),
    ReplicaPlan(stages=(StagePlan(island="amd", device_type="MI250X", ranks=(4, 5, 6, 7), layers=(0, 4)),),
                num_micro_batches=1)),
    micro_batch_size=TRAIN.micro_batch_size, global_batch_size=TRAIN.global_batch_size)

# (e) every pipeline boundary and the layers-0..2 gradient groups cross from NVIDIA to AMD: boundaries
# and gradient groups through the bridge (two replicas, uneven layers, TP2 everywhere)
CROSS_VENDOR_BOUNDARIES = Plan(replicas=(
    ReplicaPlan(stages=(StagePlan(island="nv", device_type="A100-80GB", ranks=(0, 1), layers=(0, 2)),
                        StagePlan(island="amd", device_type="MI250X", ranks=(2, 3), layers=(2, 4))),
                num_micro_batches=2),
    ReplicaPlan(stages=(StagePlan(island="nv", device_type="A100-80GB", ranks=(4, 5), layers=(0, 3)),
                        StagePlan(island="amd", device_type="MI250X", ranks=(6, 7), layers=(3, 4))),
                num_micro_batches=2)),
    micro_batch_size=TRAIN.micro_batch_size, global_batch_size=TRAIN.global_batch_size)

# (d) a homogeneous plan: our runtime and plain megatron-core on TP2 x PP2 x DP2
HOMOGENEOUS = plan(([stage([0, 1], (0, 2)), stage([2, 3], (2, 4))], 2),
                   ([stage([4, 5], (0, 2)), stage([6, 7], (2, 4))], 2))


@pytest.fixture(scope="module")
def runs():
    ref = run_local(1, megatron_block_worker, (MODEL, TRAIN, BlockShape(tp=1, pp=1, dp=1), None, PADDED_VOCAB))[0]
    init = assemble_full_state([ref.initial_shards])
    cases = list(CASES.items()) + [("bridged_nv_amd", BRIDGED, BRIDGED_CLUSTER),
                                   ("cross_vendor_boundaries", CROSS_VENDOR_BOUNDARIES, BRIDGED_CLUSTER),
                                   ("homogeneous_runtime", HOMOGENEOUS),
                                   ("homogeneous_megatron", BlockShape(tp=2, pp=2, dp=2))]
    per_rank = run_local(8, hetero_cases_worker, (MODEL, cases, TRAIN, init, PADDED_VOCAB))
    return ref, per_rank


def _losses(per_rank, name):
    """Loss list of a case from a rank that reports it (runtime: every rank; megatron: last stage)."""
    for rank_out in reversed(per_rank):
        res, _ = rank_out[name]
        losses = [log.lm_loss for log in res.iterations]
        if all(v is not None for v in losses):
            return losses
    raise AssertionError(f"{name}: no rank reported losses")


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(CASES) + ["bridged_nv_amd", "cross_vendor_boundaries", "homogeneous_runtime",
                                                 "homogeneous_megatron"])
def test_plan_matches_single_process(runs, name):
    ref, per_rank = runs
    ref_losses = [log.lm_loss for log in ref.iterations]
    losses = _losses(per_rank, name)
    assert len(losses) == TRAIN.train_iters
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{name} iteration {i + 1}: {a} vs single-process {b}"
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
    ours, theirs = _losses(per_rank, "homogeneous_runtime"), _losses(per_rank, "homogeneous_megatron")
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
