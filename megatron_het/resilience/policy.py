"""When re-routing stops paying: compare it with a re-plan over the survivors (pure).

Re-routing keeps every survivor's state in memory and loses no time, but concentrates a lost
instance's work on its peers; a re-plan (checkpoint, new plan over the survivors, reshard) costs a
restart but balances the work again. Both are predicted with the routed-schedule simulator (the
same schedule data the runtime executes) and the cheaper one in the long run wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_het.plan import Plan
from megatron_het.resilience.routed_schedule import RoutedDurationFn, routed_schedule, unit_durations
from megatron_het.resilience.routing import ReroutingError, reroute


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """How to weigh re-routing against a re-plan."""

    restart_cost_s: float = 60.0  # time a re-plan loses: checkpoint save + group rebuild + reshard load
    horizon_s: float = 3600.0  # training time left over which that cost is amortised
    iteration_s: float = 1.0  # failure-free iteration time (converts the simulator's units)

    def __post_init__(self) -> None:
        for name in ("restart_cost_s", "horizon_s", "iteration_s"):
            value = getattr(self, name)
            if not value > 0 and not (name == "restart_cost_s" and value == 0):
                raise ValueError(f"{name}: must be > 0 (got {value}). Fix: pass seconds, e.g. {name}=60")
        if self.restart_cost_s >= self.horizon_s:
            raise ValueError(f"restart_cost_s: {self.restart_cost_s} s is not below horizon_s {self.horizon_s} s. "
                             f"Fix: raise horizon_s or lower restart_cost_s")


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What to do after a failure, with the predicted throughputs (fractions of failure-free)."""

    action: str  # "reroute" or "replan"
    reason: str  # one sentence for the log
    reroute_fraction: float  # predicted throughput when re-routing (0.0 if impossible)
    replan_fraction: float  # predicted throughput of a re-plan over the survivors, restart amortised


def replan_replicas(plan: Plan, num_survivors: int) -> int:
    """Complete replicas of the plan's smallest replica shape that the survivors can form."""
    per_replica = min(len(r.ranks) for r in plan.replicas)
    return num_survivors // per_replica


def predicted_fraction(plan: Plan, failed, duration: RoutedDurationFn = unit_durations, *,
                       split_backward: bool = True, staggered: bool = False) -> float:
    """Throughput after ``failed`` as a fraction of failure-free, from the routed-schedule simulator
    with the step actions the runtime will run (``staggered.py``; the runtime's loss report is a
    world barrier after the step)."""
    if not staggered:
        base = routed_schedule(reroute(plan, ()), duration=duration, split_backward=split_backward).iteration_time
        return base / routed_schedule(reroute(plan, failed), duration=duration,
                                      split_backward=split_backward).iteration_time
    from megatron_het.resilience.staggered import steady_period

    def period(failed_ranks) -> float:
        return steady_period(reroute(plan, failed_ranks), staggered=True, split_backward=split_backward,
                             duration=duration, world_barrier=True)

    return period(()) / period(failed)


def decide(plan: Plan, failed, *, config: PolicyConfig = PolicyConfig(),
           duration: RoutedDurationFn = unit_durations, split_backward: bool = True,
           staggered: bool = False) -> Decision:
    """Re-route unless a re-plan over the survivors is predicted faster over the horizon."""
    failed = frozenset(failed)
    survivors = plan.world_size - len(failed)
    replicas = replan_replicas(plan, survivors)
    amortised = 1.0 - config.restart_cost_s / config.horizon_s
    replan = min(1.0, replicas / len(plan.replicas)) * amortised
    try:
        ratio = predicted_fraction(plan, failed, duration, split_backward=split_backward, staggered=staggered)
    except ReroutingError as err:
        return Decision(action="replan", reason=f"re-routing impossible: {err}", reroute_fraction=0.0,
                        replan_fraction=replan)
    if ratio < replan:
        return Decision(action="replan", reason=(
            f"re-routing predicts {ratio:.2f} of failure-free throughput, a re-plan over {survivors} survivors "
            f"({replicas} replicas) {replan:.2f} after amortising {config.restart_cost_s:.0f} s of restart over "
            f"{config.horizon_s:.0f} s"), reroute_fraction=ratio, replan_fraction=replan)
    return Decision(action="reroute", reason=(
        f"re-routing predicts {ratio:.2f} of failure-free throughput (re-plan: {replan:.2f})"),
        reroute_fraction=ratio, replan_fraction=replan)
