"""Staggered optimizer step as schedule actions, priced by the simulator (pure)."""

from __future__ import annotations

import pytest

from megatron_het.resilience.routed_schedule import routed_schedule
from megatron_het.resilience.routing import reroute
from megatron_het.resilience.staggered import StepAction, sharing, steady_period, step_actions

from support.resilience_grid import grid


def test_step_actions_are_data_sync_waits_for_all_staggered_for_its_own():
    r = reroute(grid(), ())
    sync = step_actions(r, staggered=False, reduce_s=0.5, step_s=1.0)
    stag = step_actions(r, staggered=True, reduce_s=0.5, step_s=1.0)
    assert sync[(0, 0)][1].after == tuple(i.key for i in r.instances) and stag[(0, 0)][1].after == ((0, 0),)
    assert sync[(0, 0)][0].after == sharing(r, (0, 0)) == ((0, 0), (1, 0), (2, 0))
    with pytest.raises(ValueError, match="kind: 'X' is not R or S"):
        StepAction(kind="X", after=(), seconds=1.0)


def test_without_steps_the_period_of_a_failure_free_plan_is_its_iteration():
    r = reroute(grid(), ())
    one = routed_schedule(r).iteration_time
    assert steady_period(r, staggered=False) == pytest.approx(one)


def test_staggered_never_slower_and_faster_after_a_failure():
    for failed in ((), (3,), (3, 0)):
        r = reroute(grid(), failed)
        sync = steady_period(r, staggered=False, reduce_s=0.5, step_s=1.0)
        stag = steady_period(r, staggered=True, reduce_s=0.5, step_s=1.0)
        assert stag <= sync + 1e-9, (failed, stag, sync)
    # 8 replicas x 4 stages, a last stage lost: its peer's deferred W work overlaps the next iteration's
    # start on the other stages (measured by the simulator: 34.5 -> 31.5 units)
    r = reroute(grid(8, 4, 8), (7,))
    sync = steady_period(r, staggered=False, reduce_s=0.5, step_s=1.0)
    stag = steady_period(r, staggered=True, reduce_s=0.5, step_s=1.0)
    assert stag < sync, (stag, sync)


def test_synchronous_period_is_the_busiest_chain_plus_reduce_and_step():
    r = reroute(grid(), (3,))
    one = routed_schedule(r).iteration_time
    assert steady_period(r, staggered=False, reduce_s=0.5, step_s=1.0) == pytest.approx(one + 1.5)


def test_a_world_barrier_after_the_step_takes_the_staggered_gain_away():
    r = reroute(grid(8, 4, 8), (7,))
    sync = steady_period(r, staggered=False, reduce_s=0.5, step_s=1.0)
    barrier = steady_period(r, staggered=True, reduce_s=0.5, step_s=1.0, world_barrier=True)
    assert barrier == pytest.approx(sync)


def test_policy_modes_and_the_priced_schedule():
    from megatron_het.resilience.policy import Decision, decide, predicted_fraction
    from megatron_het.resilience.recovery import forced

    plan = grid()
    # the policy prices the schedule the run uses: the staggered step with the runtime's world barrier
    r = reroute(plan, (3,))
    expected = (steady_period(reroute(plan, ()), staggered=True, world_barrier=True)
                / steady_period(r, staggered=True, world_barrier=True))
    assert predicted_fraction(plan, (3,), staggered=True) == pytest.approx(expected)
    assert decide(plan, (3,), split_backward=False).reroute_fraction == pytest.approx(
        predicted_fraction(plan, (3,), split_backward=False))
    replan = Decision(action="replan", reason="r", reroute_fraction=0.4, replan_fraction=0.6)
    assert forced(replan, "reroute").action == "reroute" and forced(replan, "auto").action == "replan"
    impossible = Decision(action="replan", reason="r", reroute_fraction=0.0, replan_fraction=0.6)
    assert forced(impossible, "reroute").action == "replan"  # nothing to re-route onto
    keep = Decision(action="reroute", reason="r", reroute_fraction=0.9, replan_fraction=0.6)
    assert forced(keep, "replan").action == "replan"
    with pytest.raises(ValueError, match="spread: 0 is below 1"):
        reroute(plan, (3,), spread=0)
