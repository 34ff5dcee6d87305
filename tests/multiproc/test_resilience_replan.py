"""Automatic re-plan: re-routing stops paying, the survivors checkpoint, re-plan, reshard, continue.

One 6-rank gloo spawn (3 replicas x 2 stages, TP=1, 2 micro-batches each) trains the plan
failure-free (the reference), then again from the same initial weights with the default policy
while rank 3 (replica 1, stage 1) is SIGKILLed in iteration 1 -- re-routed, one peer of stage 1
left busier -- and rank 1 (replica 0, stage 1) in iteration 3. Then a single instance holds layers
2..4 and re-routing predicts 0.37 of failure-free throughput against 0.66 for a re-plan over the 4
survivors (2 replicas of 2 stages), so the survivors write a checkpoint, build the 2x2 plan, load
it resharded and redo iteration 3. Every iteration's loss must equal the reference (relative 1e-5,
fp32: the global batch is kept, so the update is the same), every sample be read exactly once,
the log say AUTOMATIC RE-PLAN with the predicted figures, and the checkpoint be complete.
Both runs start from one full initial state so that the tied output weight equals the embedding
(see ``initial_state_worker``).
"""

from __future__ import annotations

import os

import pytest

from megatron_het.cluster import ModelSpec
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.resilience.launch import run_resilient_local
from megatron_het.resilience.policy import decide
from megatron_het.resilience.recovery import FaultSpec
from megatron_het.resilience.routing import reroute
from megatron_het.resilience.worker import resilient_worker
from megatron_het.train.config import TrainConfig

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=200)
TRAIN = TrainConfig(micro_batch_size=2, global_batch_size=12, train_iters=6, lr=1e-3)
ITERATIONS = 6
REPLAN_AT = 3  # iteration (0-based) interrupted by the second failure, redone under the new plan
FAULTS = (FaultSpec(rank=3, iteration=1, after_actions=1), FaultSpec(rank=1, iteration=REPLAN_AT, after_actions=2))
SURVIVORS = (0, 2, 4, 5)


def three_by_two() -> Plan:
    def stage(rank, layers):
        return StagePlan(island="cpu", device_type="CPU", ranks=(rank,), layers=layers)

    return Plan(replicas=tuple(ReplicaPlan(stages=(stage(2 * r, (0, 2)), stage(2 * r + 1, (2, 4))),
                                           num_micro_batches=2) for r in range(3)),
                micro_batch_size=TRAIN.micro_batch_size, global_batch_size=TRAIN.global_batch_size)


def initial_state_worker(rank, world_size):
    """Full initial tensors of a one-stage model (its output layer *is* the word embedding)."""
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    enable_cpu_backend()
    one = Plan(replicas=(ReplicaPlan(stages=(StagePlan(island="cpu", device_type="CPU", ranks=(0,), layers=(0, 4)),),
                                     num_micro_batches=6),),
               micro_batch_size=TRAIN.micro_batch_size, global_batch_size=TRAIN.global_batch_size)
    return HeteroTrainer(model=MODEL, plan=one, train=TRAIN, batch_fn=None).shards()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megatron_het.checkpoint.full_state import assemble_full_state
    from megatron_het.platform.local_launch import run_local

    ckpt = str(tmp_path_factory.mktemp("replan_ckpt"))
    # Both runs start from one full state: without it the last stage's tied output weight starts
    # independently of the embedding, and the checkpoint (one copy per tensor) cannot restore both.
    init = assemble_full_state(run_local(1, initial_state_worker, ()))
    # Generous, bounded timeouts: 6 processes on 2 shared cores; a SIGKILL is seen within ~1 s anyway.
    overrides = {"heartbeat_timeout_s": 5.0, "pg_timeout_s": 30.0, "agreement_timeout_s": 60.0,
                 "checkpoint_dir": ckpt}
    outcomes = run_resilient_local(6, resilient_worker, (MODEL, three_by_two(), TRAIN, ITERATIONS, FAULTS,
                                                         overrides, True, None, None, init),
                                   timeout_s=900, pg_timeout_s=30.0)
    return outcomes, ckpt


def _survivor_reports(outcomes):
    return {o.rank: o.result["report"] for o in outcomes if o.status == "ok"}


@pytest.mark.slow
@pytest.mark.multiproc
def test_killed_ranks_die_and_the_survivors_finish_after_one_replan(run):
    outcomes, _ = run
    assert [o.status for o in outcomes] == ["ok", "died", "ok", "died", "ok", "ok"]
    assert outcomes[1].exitcode == -9 and outcomes[3].exitcode == -9
    reports = _survivor_reports(outcomes)
    assert {r: rep.status for r, rep in reports.items()} == dict.fromkeys(SURVIVORS, "finished")
    for rep in reports.values():
        assert len(rep.replans) == 1, rep.replans
        assert f"2 replicas on 4 of 4 survivors, resuming from iteration {REPLAN_AT}" in rep.replans[0]
        # the first failure was re-routed in-process (one event); the second one ended in the re-plan
        assert [e.failed for e in rep.events] == [(3,)] and "reroute" in rep.events[0].decision


@pytest.mark.slow
@pytest.mark.multiproc
def test_log_says_automatic_replan_with_the_predicted_figures(run):
    outcomes, _ = run
    expected = decide(three_by_two(), {1, 3})
    assert expected.action == "replan" and 0 < expected.reroute_fraction < expected.replan_fraction
    for o in outcomes:
        if o.status != "ok":
            continue
        lines = [line for line in o.result["log"] if "AUTOMATIC RE-PLAN" in line]
        assert len(lines) == 1, o.result["log"]
        assert f"re-routing predicts {expected.reroute_fraction:.2f}" in lines[0], lines[0]
        assert f"over 4 survivors (2 replicas) {expected.replan_fraction:.2f}" in lines[0], lines[0]
        assert f"ranks [1] failed in iteration {REPLAN_AT}" in lines[0], lines[0]
        assert f"from the survivors' state (iteration {REPLAN_AT})" in lines[0], lines[0]


@pytest.mark.slow
@pytest.mark.multiproc
def test_losses_equal_the_failure_free_run_before_and_after_the_replan(run):
    outcomes, _ = run
    ref = outcomes[0].result["reference"]
    assert sorted(ref) == list(range(1, ITERATIONS + 1))
    for rank, rep in _survivor_reports(outcomes).items():
        assert sorted(rep.losses) == list(range(1, ITERATIONS + 1)), (rank, rep.losses)
        for it, loss in rep.losses.items():
            assert abs(loss - ref[it]) <= 1e-5 * abs(ref[it]), f"rank {rank} iteration {it}: {loss} vs {ref[it]}"


def _instance_samples(plan: Plan, failed, key) -> list[int]:
    """Samples the instance ``key`` processes per iteration under the routing for ``failed``."""
    routing, mbs = reroute(plan, failed), plan.micro_batch_size
    return [g * mbs + i for p in routing.pipelines if key in p.hops for g in p.micro_batches for i in range(mbs)]


@pytest.mark.slow
@pytest.mark.multiproc
def test_every_sample_read_exactly_once(run):
    """Per completed iteration, first stages embedded and last stages scored each sample once.

    The killed ranks (both last stages) report nothing; what they scored in the iterations they
    completed is added back from the same pure routing the runtime executed: rank 3 scored replica
    1's samples in iteration 0, rank 1 its own replica's in iteration 0 and its routed share in 1..2.
    """
    outcomes, _ = run
    reports = _survivor_reports(outcomes).values()
    plan = three_by_two()
    lost_scored = {0: _instance_samples(plan, (), (1, 1)) + _instance_samples(plan, (), (0, 1)),
                   1: _instance_samples(plan, (3,), (0, 1)), 2: _instance_samples(plan, (3,), (0, 1))}
    assert lost_scored[0] == [4, 5, 6, 7, 0, 1, 2, 3] and len(lost_scored[1]) > 4  # rank 1 carried extra
    for it in range(ITERATIONS):
        embedded = [s for r in reports for s in r.embedded.get(it, ())]
        scored = [s for r in reports for s in r.scored.get(it, ())] + lost_scored.get(it, [])
        assert sorted(embedded) == list(range(TRAIN.global_batch_size)), ("embedded", it, sorted(embedded))
        assert sorted(scored) == list(range(TRAIN.global_batch_size)), ("scored", it, sorted(scored))


@pytest.mark.slow
@pytest.mark.multiproc
def test_checkpoint_is_complete_and_atomically_written(run):
    from megatron_het.checkpoint.dist_ckpt import iteration_dir, latest_iteration, read_common

    _, ckpt = run
    assert latest_iteration(ckpt) == REPLAN_AT
    entries = sorted(os.listdir(ckpt))
    assert entries == ["iter_0000003", "latest_checkpointed_iteration.txt"], entries  # no .tmp left behind
    common = read_common(iteration_dir(ckpt, REPLAN_AT))
    assert common["iteration"] == REPLAN_AT
    assert common["consumed_samples"] == REPLAN_AT * TRAIN.global_batch_size
    assert len(common["plan"]["replicas"]) == 3  # written by the survivors under the original plan
