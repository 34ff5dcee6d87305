"""The optimizer step as schedule actions, and the steady-state iteration period they give (pure).

After its last backward of an iteration, every stage instance runs two more actions:

- ``R``: reduce its gradients with the other holders of the same layers (the data-parallel peers,
  after a failure also the peers that covered part of a lost stage): it cannot end before every
  instance sharing one of its layers has finished its backward;
- ``S``: its optimizer step.

**Synchronous** (this runtime's default step): every ``S`` waits for every ``R`` (the global gradient
norm and the loss report are world-wide collectives before the step), so the next iteration starts
on all instances together after the slowest one. **Staggered** (ReCycle's second optimisation):
``S`` waits only for its own ``R``, and the instance starts its next iteration's forwards right
after it; the work a failure added to some peers then overlaps the next iteration of the others,
instead of every instance waiting for the busiest. ``steady_period`` chains iterations through
``routed_schedule(start=...)`` with these actions and returns the steady-state period: the
prediction the policy and the benchmark use for both modes.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_het.resilience.routed_schedule import RoutedDurationFn, routed_schedule, unit_durations
from megatron_het.resilience.routing import InstanceKey, Routing


@dataclass(frozen=True, kw_only=True)
class StepAction:
    """One optimizer-side action of an instance in an iteration."""

    kind: str  # "R": gradient reduction with the holders of its layers; "S": optimizer step
    after: tuple[InstanceKey, ...]  # instances whose previous action (R: backward end, S: R) must end first
    seconds: float  # its duration (same unit as the compute durations)

    def __post_init__(self) -> None:
        if self.kind not in ("R", "S"):
            raise ValueError(f"kind: {self.kind!r} is not R or S. Fix: R = gradient reduction, S = optimizer step")
        if self.seconds < 0:
            raise ValueError(f"seconds: {self.seconds} is negative (kind {self.kind}). Fix: pass a duration >= 0")


def sharing(routing: Routing, key: InstanceKey) -> tuple[InstanceKey, ...]:
    """Instances holding at least one layer that ``key`` holds (its gradient-reduction peers, itself included)."""
    lo, hi = routing.instance(key).layers
    return tuple(i.key for i in routing.instances if i.layers[0] < hi and lo < i.layers[1])


def step_actions(routing: Routing, *, staggered: bool, reduce_s: float, step_s: float
                 ) -> dict[InstanceKey, tuple[StepAction, StepAction]]:
    """Per instance, its (R, S) actions: S after its own R (staggered) or after every R (synchronous)."""
    everyone = tuple(i.key for i in routing.instances)
    return {i.key: (StepAction(kind="R", after=sharing(routing, i.key), seconds=reduce_s),
                    StepAction(kind="S", after=(i.key,) if staggered else everyone, seconds=step_s))
            for i in routing.instances}


def steady_period(routing: Routing, *, staggered: bool, reduce_s: float = 0.0, step_s: float = 0.0,
                  split_backward: bool = True, duration: RoutedDurationFn = unit_durations,
                  iterations: int = 4, world_barrier: bool = False) -> float:
    """Steady-state time per iteration of ``routing`` with the step actions (simulated, pure).

    ``world_barrier``: a world-wide collective after every step (this runtime's loss report) holds
    every instance's next iteration until the last step has ended; without it (ReCycle) an instance
    starts its next iteration right after its own step."""
    if iterations < 2:
        raise ValueError(f"iterations: {iterations} is below 2. Fix: simulate at least 2 to measure a period")
    actions = step_actions(routing, staggered=staggered, reduce_s=reduce_s, step_s=step_s)
    start: dict[InstanceKey, float] = {}
    ends = []
    for _ in range(iterations):
        sched = routed_schedule(routing, split_backward=split_backward, duration=duration, start=start)
        reduced = {k: max(sched.finish[j] for j in r.after) + r.seconds for k, (r, _) in actions.items()}
        start = {k: max(reduced[j] for j in s.after) + s.seconds for k, (_, s) in actions.items()}
        ends.append(max(start.values()))
        if world_barrier:
            start = dict.fromkeys(start, ends[-1])
    return (ends[-1] - ends[0]) / (iterations - 1)
