"""Pure parts of resilience: routing, routed schedules, policy, agreement, split backward."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from megatron_het.platform.local_launch import free_port
from megatron_het.resilience.agreement import AgreementError, agree_on_failures
from megatron_het.resilience.policy import PolicyConfig, decide, predicted_fraction
from megatron_het.resilience.routed_schedule import routed_schedule
from megatron_het.resilience.routing import ReroutingError, describe, reroute

from support.resilience_grid import grid


# ---- routing ---------------------------------------------------------------------------------
def test_no_failure_keeps_the_plan():
    r = reroute(grid(), ())
    assert [(p.hops, p.micro_batches) for p in r.pipelines] == [
        (((0, 0), (0, 1)), (0, 1, 2, 3)), (((1, 0), (1, 1)), (4, 5, 6, 7)), (((2, 0), (2, 1)), (8, 9, 10, 11))]
    assert r.takeovers == () and r.retired == () and r.survivors == (0, 1, 2, 3, 4, 5)


def test_lost_stage_is_taken_over_by_a_peer_and_work_rebalanced():
    r = reroute(grid(), (3,))  # replica 1, stage 1
    assert r.pipelines[1].hops == ((1, 0), (0, 1))
    assert [len(p.micro_batches) for p in r.pipelines] == [3, 3, 6]  # the shared stage-1 instance runs 6
    assert max(r.load(i.key) for i in r.instances) == 6
    assert r.survivors == (0, 1, 2, 4, 5) and r.new_rank(4) == 3
    assert describe(r) == ["stage 1 of replica 1 (lost) -> replica 0 stage 1 (ranks [1]) runs global "
                           "micro-batches [3, 4, 5]"]


@pytest.mark.parametrize("failed", [(), (3,), (3, 0), (1, 3), (0, 2, 5)])
def test_every_sample_exactly_once(failed):
    r = reroute(grid(), failed)
    assert sorted(r.samples()) == list(range(24))


def test_two_failures_in_different_stages_keep_two_thirds():
    r = reroute(grid(), (3, 0))
    assert max(r.load(i.key) for i in r.instances) == 6  # 12 micro-batches over 2 instances per stage


def test_tp_group_losing_a_rank_retires_its_peers():
    r = reroute(grid(replicas=2, stages=2, micro=2, tp=2), (2,))  # replica 0 stage 1 = ranks 2, 3
    assert r.retired == (3,) and 3 not in r.survivors and r.pipelines[0].hops == ((0, 0), (1, 1))


def test_stage_without_survivors_cannot_be_rerouted():
    with pytest.raises(ReroutingError, match=r"replicas\[0\]\.stages\[1\].*layers \[2, 4\].*Fix: restart"):
        reroute(grid(replicas=2), (1, 3))
    with pytest.raises(ReroutingError, match=r"ranks \[9\] are not in the plan"):
        reroute(grid(), (9,))


# ---- routed schedules --------------------------------------------------------------------------
def _check_dependencies(r, sched):
    """Replay the lists in simulated order: every F/B/W after its dependencies (no deadlock)."""
    pos = {}
    for k, acts in sched.actions.items():
        for i, a in enumerate(acts):
            pos[(k, a.kind, a.micro_batch)] = i
    for p in r.pipelines:
        for g in p.micro_batches:
            for s, hop in enumerate(p.hops):
                assert (hop, "F", g) in pos and (hop, "B", g) in pos
                assert pos[(hop, "F", g)] < pos[(hop, "B", g)]
                if sched.split_backward:
                    assert pos[(hop, "B", g)] < pos[(hop, "W", g)]


@pytest.mark.parametrize("failed", [(), (3,), (3, 0)])
@pytest.mark.parametrize("split", [True, False])
def test_routed_schedule_is_complete(failed, split):
    r = reroute(grid(), failed)
    sched = routed_schedule(r, split_backward=split)
    _check_dependencies(r, sched)
    per = 3 if split else 2
    assert sum(len(a) for a in sched.actions.values()) == per * sum(len(p.micro_batches) * len(p.hops)
                                                                      for p in r.pipelines)


def test_split_backward_fills_bubbles():
    r = reroute(grid(replicas=1, stages=4, micro=8), ())
    fused, split = routed_schedule(r, split_backward=False), routed_schedule(r, split_backward=True)
    assert split.iteration_time < fused.iteration_time
    assert split.bubble_fraction() < fused.bubble_fraction()
    # 1F1B on 4 stages, 8 micro-batches, F=1 B=2: (8 + 3) x 3 = 33 time units
    assert fused.iteration_time == 33.0


def test_predicted_fraction_after_failures():
    plan = grid()
    assert predicted_fraction(plan, ()) == 1.0
    one, two = predicted_fraction(plan, (3,)), predicted_fraction(plan, (3, 0))
    assert 0.6 < one < 0.75 and 0.6 < two < 0.75  # a stage group keeps 2 of 3 instances either way
    assert predicted_fraction(plan, (3, 5)) < 0.4  # one instance left in stage 1


# ---- policy ------------------------------------------------------------------------------------
def test_policy_reroutes_until_it_no_longer_pays():
    plan = grid()
    assert decide(plan, (3,)).action == "reroute"
    d = decide(plan, (3, 5))  # stage 1 has one instance left: 0.33 vs a re-plan on 4 ranks (2 replicas)
    assert d.action == "replan" and "re-plan over 4 survivors" in d.reason and d.reroute_fraction < d.replan_fraction
    d = decide(grid(replicas=2), (1, 3))
    assert d.action == "replan" and d.reroute_fraction == 0.0 and "impossible" in d.reason
    # an expensive restart over a short horizon: keep re-routing
    assert decide(plan, (3, 5), config=PolicyConfig(restart_cost_s=500, horizon_s=600)).action == "reroute"


def test_policy_config_validation_names_the_field():
    with pytest.raises(ValueError, match=r"restart_cost_s: 700 s is not below horizon_s 600 s"):
        PolicyConfig(restart_cost_s=700, horizon_s=600)
    with pytest.raises(ValueError, match=r"horizon_s: must be > 0 \(got -1\)"):
        PolicyConfig(horizon_s=-1)


# ---- agreement ---------------------------------------------------------------------------------
def _store():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    return master, port


def test_agreement_declares_silent_ranks_failed_and_all_agree():
    master, port = _store()
    import time

    now = time.time()
    for r in (0, 1, 2):
        master.set(f"hb/{r}", repr(now))
    master.set("hb/3", repr(now - 100))  # rank 3 stopped beating long ago
    results = {}

    def run(rank):
        client = dist.TCPStore("127.0.0.1", port, is_master=False)
        results[rank] = agree_on_failures(client, generation=1, rank=rank, members=(0, 1, 2, 3), iteration=7,
                                          heartbeat_timeout_s=1.0, timeout_s=5.0)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert {r: a.failed for r, a in results.items()} == {0: (3,), 1: (3,), 2: (3,)}
    assert len({a.decided_by for a in results.values()}) == 1
    assert all(a.waited_s < 5.0 for a in results.values())


def test_agreement_refuses_survivors_in_different_iterations():
    master, port = _store()
    import time

    master.set("hb/0", repr(time.time()))
    master.set("agree/1/here/1", "4")  # rank 1 already announced iteration 4
    with pytest.raises(AgreementError, match=r"different iterations.*Fix: restart"):
        agree_on_failures(master, generation=1, rank=0, members=(0, 1), iteration=5, heartbeat_timeout_s=1.0,
                          timeout_s=5.0)
    with pytest.raises(ValueError, match=r"heartbeat_timeout_s/timeout_s.*got 5.0 and 1.0"):
        agree_on_failures(master, generation=2, rank=0, members=(0,), iteration=0, heartbeat_timeout_s=5.0,
                          timeout_s=1.0)


# ---- re-plan and configuration -----------------------------------------------------------------
def test_homogeneous_replan_keeps_the_global_batch():
    from megatron_het.resilience.worker import homogeneous_replan

    plan = homogeneous_replan(grid(), 5)  # 5 survivors hold two 2-rank replicas
    assert [r.num_micro_batches for r in plan.replicas] == [6, 6]
    assert [st.ranks for r in plan.replicas for st in r.stages] == [(0,), (1,), (2,), (3,)]
    with pytest.raises(ValueError, match=r"num_ranks: 1 survivors cannot hold one replica of 2 ranks"):
        homogeneous_replan(grid(), 1)


def test_instances_plan_renumbers_survivors_contiguously():
    from megatron_het.resilience.recovery import instances_plan

    r = reroute(grid(replicas=2, stages=2, micro=2, tp=2), (2,))  # ranks 2 and 3 leave
    plan = instances_plan(r, grid(replicas=2, stages=2, micro=2, tp=2))
    assert [rep.stages[0].ranks for rep in plan.replicas] == [(0, 1), (2, 3), (4, 5)]
    assert [rep.stages[0].layers for rep in plan.replicas] == [(0, 2), (0, 2), (2, 4)]


def test_resilience_config_validation_names_the_fields():
    from megatron_het.resilience.agreement import StoreAddress
    from megatron_het.resilience.recovery import ResilienceConfig

    with pytest.raises(ValueError, match=r"heartbeat_interval_s/heartbeat_timeout_s.*got 1.0, 0.5, 60.0"):
        ResilienceConfig(store=StoreAddress(host="h", port=1), heartbeat_interval_s=1.0, heartbeat_timeout_s=0.5)
    with pytest.raises(ValueError, match=r"port: must be in 1..65535 \(got 0\)"):
        StoreAddress(host="h", port=0)


def test_resilience_refuses_the_distributed_optimizer_naming_the_fix():
    """A dead rank's optimizer shards are gone: the hooks refuse such a plan up front."""
    import dataclasses

    from megatron_het.cluster import ConfigError
    from megatron_het.resilience.agreement import StoreAddress
    from megatron_het.resilience.recovery import ResilienceConfig, ResilienceHooks

    config = ResilienceConfig(store=StoreAddress(host="127.0.0.1", port=1))
    plan = dataclasses.replace(grid(), use_distributed_optimizer=True)
    with pytest.raises(ConfigError, match=r"use_distributed_optimizer.*drop --hetero-resilience"):
        ResilienceHooks(config=config, rank=0, plan=plan)
