"""Resilience on a cross-vendor cluster (issue 14, item 3): after a failure, the re-routed pipeline
boundaries and the rebuilt gradient groups go through the het bridge where their ranks use different
collective libraries, as the plan's own groups do.

Four ranks on an emulated A100 + MI250X cluster: two replicas of two stages, stage 0 on the NVIDIA
island (ranks 0, 2), stage 1 on the AMD island (ranks 1, 3). Rank 3 is killed in iteration 1; replica
1's micro-batches are re-routed from rank 2 (A100) to rank 1 (MI250X), a new cross-vendor boundary.
Counters of the bridge groups built for the routed boundaries must show traffic on every survivor,
the tied word embedding's rebuilt gradient group (first and last stages: both islands) must be
bridged, and every loss must equal the failure-free run (relative 1e-5, fp32, as the other
resilience tests). Without the bridges in ``routed_links`` the routed boundaries run plain p2p and
their bridges' counters stay at 0.
"""

from __future__ import annotations

import pytest

from megatron_het.cluster import ModelSpec
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.resilience.launch import run_resilient_local
from megatron_het.resilience.recovery import FaultSpec
from megatron_het.resilience.worker import resilient_worker
from megatron_het.train.config import TrainConfig

from support.survivors import assert_survivors_match

MODEL = ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100)
TRAIN = TrainConfig(micro_batch_size=1, global_batch_size=4, train_iters=4, lr=1e-3)
ITERATIONS = 4
CLUSTER = {"islands": [{"name": "nv", "device": "A100-80GB", "nodes": 1, "gpus_per_node": 2},
                       {"name": "amd", "device": "MI250X", "nodes": 1, "gpus_per_node": 2}],
           "links": [{"between": ["nv", "amd"], "bandwidth_gbps": 100}]}
PLAN = Plan(replicas=tuple(ReplicaPlan(stages=(StagePlan(island="nv", device_type="A100-80GB", ranks=(2 * r,),
                                                         layers=(0, 1)),
                                               StagePlan(island="amd", device_type="MI250X", ranks=(2 * r + 1,),
                                                         layers=(1, 2))),
                                       num_micro_batches=2) for r in range(2)),
            micro_batch_size=1, global_batch_size=4)
FAULTS = (FaultSpec(rank=3, iteration=1, after_actions=1),)
TIMEOUTS = {"heartbeat_timeout_s": 5.0, "pg_timeout_s": 10.0, "agreement_timeout_s": 30.0}


@pytest.fixture(scope="module")
def outcomes():
    return run_resilient_local(4, resilient_worker, (MODEL, PLAN, TRAIN, ITERATIONS, FAULTS, TIMEOUTS, True, None,
                                                     1.0, None, None, CLUSTER), timeout_s=600)


@pytest.mark.slow  # about 90 s: a failure detected by a 10 s group timeout on 2 shared cores
@pytest.mark.multiproc
def test_rerouted_boundaries_and_rebuilt_gradient_groups_use_the_bridge(outcomes):
    assert [o.status for o in outcomes] == ["ok", "ok", "ok", "died"]
    reports = {o.rank: o.result["report"] for o in outcomes if o.status == "ok"}
    assert {r: rep.status for r, rep in reports.items()} == {0: "finished", 1: "finished", 2: "finished"}
    print({r: (rep.boundary_bridge_bytes, rep.gradient_routes) for r, rep in reports.items()})
    for r, rep in reports.items():
        assert len(rep.events) == 1, (r, rep.events)
        assert rep.boundary_bridge_bytes > 0, f"rank {r}: no routed boundary went through the bridge"
        assert "het-bridge" in rep.gradient_routes, (r, rep.gradient_routes)


@pytest.mark.slow  # about 90 s: a failure detected by a 10 s group timeout on 2 shared cores
@pytest.mark.multiproc
def test_losses_equal_the_failure_free_run(outcomes):
    ref = outcomes[0].result["reference"]
    assert_survivors_match(outcomes, ref, ITERATIONS)
