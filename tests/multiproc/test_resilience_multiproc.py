"""Ranks killed with SIGKILL mid-training: the survivors continue in-process, exactly.

One 6-rank gloo spawn (3 replicas x 2 stages, TP=1) first trains the plan failure-free (the
reference), then trains it again from the same initial weights while rank 3 (replica 1, stage 1)
kills itself in iteration 2 and rank 0 (replica 0, stage 0) in iteration 4. Every iteration's loss
must equal the reference (relative 1e-5, fp32), every sample of every global batch must be read
exactly once, and the survivors must resume within a bounded time.
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

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=200)
TRAIN = TrainConfig(micro_batch_size=2, global_batch_size=12, train_iters=6, lr=1e-3)
ITERATIONS = 6
FAULTS = (FaultSpec(rank=3, iteration=1, after_actions=1), FaultSpec(rank=0, iteration=3, after_actions=2))
RESUME_BOUND_S = 20.0  # from the kill to the survivors' new groups, on 2 shared CPU cores


def three_by_two() -> Plan:
    def stage(rank, layers):
        return StagePlan(island="cpu", device_type="CPU", ranks=(rank,), layers=layers)

    return Plan(replicas=tuple(ReplicaPlan(stages=(stage(2 * r, (0, 2)), stage(2 * r + 1, (2, 4))),
                                           num_micro_batches=2) for r in range(3)),
                micro_batch_size=TRAIN.micro_batch_size, global_batch_size=TRAIN.global_batch_size)


@pytest.fixture(scope="module")
def outcomes():
    return run_resilient_local(6, resilient_worker, (MODEL, three_by_two(), TRAIN, ITERATIONS, FAULTS,
                                                     {"heartbeat_timeout_s": 5.0, "pg_timeout_s": 10.0, "agreement_timeout_s": 30.0}, True), timeout_s=600)


@pytest.mark.multiproc
def test_killed_ranks_die_and_the_others_finish(outcomes):
    assert [o.status for o in outcomes] == ["died", "ok", "ok", "died", "ok", "ok"]
    assert outcomes[0].exitcode == -9 and outcomes[3].exitcode == -9
    assert {o.rank: o.result["report"].status for o in outcomes if o.status == "ok"} == {
        1: "finished", 2: "finished", 4: "finished", 5: "finished"}


@pytest.mark.multiproc
def test_losses_equal_the_failure_free_run(outcomes):
    ref = outcomes[1].result["reference"]
    assert sorted(ref) == list(range(1, ITERATIONS + 1))
    assert_survivors_match(outcomes, ref, ITERATIONS)


@pytest.mark.multiproc
def test_every_sample_read_exactly_once(outcomes):
    """Per completed iteration, first stages embedded and last stages scored each sample once.

    Killed ranks report nothing; their share of the iterations they completed is added back:
    rank 3 (last stage of replica 1: samples 4..7) completed iteration 0, rank 0 (first stage of
    replica 0: samples 0..3) iterations 0..2.
    """
    reports = [o.result["report"] for o in outcomes if o.status == "ok"]
    for first_stage in (True, False):
        for it in range(ITERATIONS):
            seen = [s for r in reports for s in (r.embedded if first_stage else r.scored).get(it, ())]
            if first_stage and it < 3:
                seen += list(range(0, 4))
            if not first_stage and it < 1:
                seen += list(range(4, 8))
            assert sorted(seen) == list(range(TRAIN.global_batch_size)), (first_stage, it, sorted(seen))


@pytest.mark.multiproc
def test_each_failure_logged_with_takeovers_and_bounded_resume(outcomes):
    events = outcomes[1].result["report"].events
    assert [e.failed for e in events] == [(3,), (0,)]
    assert [e.iteration for e in events] == [1, 3]
    assert "replica 0 stage 1" in events[0].takeovers[0] and "reroute" in events[0].decision
    assert "stage 0 of replica 0 (lost) -> replica " in " ".join(events[1].takeovers)
    for e in events:
        assert e.resumed_at - e.detected_at < RESUME_BOUND_S, e
    assert [e.world_size for e in events] == [5, 4]
