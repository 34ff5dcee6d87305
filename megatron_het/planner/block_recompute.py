"""The least block recomputation each recomputing stage needs (Megatron's --recompute-method block).

The search prices a stage short of memory with full recomputation (every layer's forward redone in
backward), which costs about a third more compute per layer; such a stage often fits with only its
first few layers per model chunk recomputing (``StagePlan.recompute_num_layers``). This trims every
fully recomputing stage to the least count whose memory, computed exactly as perf.predict computes
it, fits the device, so the plan pays for no more recomputation than it needs.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_het.cluster import ClusterSpec, ModelSpec
from megatron_het.perf.memory import device_capacity_bytes
from megatron_het.perf.predict import plan_stage_memory
from megatron_het.plan.types import Plan, ReplicaPlan

__all__ = ["least_recompute_layers"]


def least_recompute_layers(plan: Plan, model: ModelSpec, cluster: ClusterSpec, *, seq_length: int | None = None,
                           flash_attention: bool | None = None, recompute_mode: str | None = None) -> Plan:
    """``plan`` with every stage that recomputes all its layers (``recompute=True``,
    ``recompute_num_layers == 0``; model chunks, when listed, of equal size) given the least N in 1..layers per chunk
    whose memory (perf.predict's, against the device's capacity) fits; N equal to the layers per
    chunk stays 0 (all), as does a stage no N fits. Selective recomputation: ``plan`` unchanged.
    The options mean what they mean to :func:`megatron_het.perf.predict.predict`."""
    if recompute_mode not in (None, "full"):
        return plan
    s_len = model.seq_length if seq_length is None else seq_length
    v, dp = plan.virtual_pipeline_size, len(plan.replicas)
    chosen: dict[tuple[object, ...], int] = {}  # stage signature -> N (0: all)

    def least(r: ReplicaPlan, i: int) -> int:
        st, p = r.stages[i], len(r.stages)
        key = (st.island, st.tp, st.num_layers, i, p, r.num_micro_batches)
        if key not in chosen:
            capacity = device_capacity_bytes(cluster.island(st.island).device)
            chosen[key] = 0
            for n in range(1, st.num_layers // v):  # memory need not fall monotonically with N: scan upward
                mem = plan_stage_memory(plan, r, i, model, cluster, dp=dp,
                                        distributed_optimizer=plan.use_distributed_optimizer, seq_length=s_len,
                                        flash_attention=flash_attention, recompute_num_layers=n)
                if mem.total_bytes <= capacity:
                    chosen[key] = n
                    break
        return chosen[key]

    replicas, changed = [], False
    for r in plan.replicas:
        stages = []
        for i, st in enumerate(r.stages):
            # chunk_layers: only equal chunks (the planner's interleaved variants), which stage_memory prices
            equal = all(b - a == st.num_layers // v for a, b in st.chunk_layers)
            if st.recompute and not st.recompute_num_layers and equal and st.num_layers // v > 1:
                n = least(r, i)
                if n:
                    st = replace(st, recompute_num_layers=n)
            stages.append(st)
        if tuple(stages) != r.stages:
            r, changed = replace(r, stages=tuple(stages)), True
        replicas.append(r)
    return replace(plan, replicas=tuple(replicas)) if changed else plan
