"""Resilient training without spare GPUs: detect, agree, re-route micro-batches to peers, continue.

See docs/resilience.md. Pure parts (routing, routed schedules, policy) import no process groups.
"""

from megatron_het.resilience.policy import Decision, PolicyConfig, decide, predicted_fraction
from megatron_het.resilience.routed_schedule import RoutedSchedule, routed_schedule, unit_durations
from megatron_het.resilience.routing import (
    Pipeline,
    ReroutingError,
    Routing,
    StageInstance,
    Takeover,
    describe,
    reroute,
)

__all__ = [
    "Decision",
    "Pipeline",
    "PolicyConfig",
    "ReroutingError",
    "RoutedSchedule",
    "Routing",
    "StageInstance",
    "Takeover",
    "decide",
    "describe",
    "predicted_fraction",
    "reroute",
    "routed_schedule",
    "unit_durations",
]
