"""The plan grid of the pure resilience tests: ``replicas`` x ``stages`` CPU stages of ``tp`` ranks each,
a 4-layer model split evenly, ``micro`` micro-batches of 2 per replica."""

from __future__ import annotations

from megatron_het.plan import Plan, ReplicaPlan, StagePlan


def grid(replicas=3, stages=2, micro=4, tp=1) -> Plan:
    per = stages * tp
    layers = [(s * 4 // stages, (s + 1) * 4 // stages) for s in range(stages)]
    return Plan(replicas=tuple(
        ReplicaPlan(stages=tuple(StagePlan(island="cpu", device_type="CPU",
                                           ranks=tuple(range(r * per + s * tp, r * per + (s + 1) * tp)),
                                           layers=layers[s]) for s in range(stages)),
                    num_micro_batches=micro) for r in range(replicas)),
        micro_batch_size=2, global_batch_size=2 * micro * replicas)
