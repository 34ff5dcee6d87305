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
from megatron_het.perf.memory import device_capacity_bytes, microbatches_in_flight, stage_memory
from megatron_het.plan.types import Plan

__all__ = ["least_recompute_layers"]


def least_recompute_layers(plan: Plan, model: ModelSpec, cluster: ClusterSpec, *, seq_length: int | None = None,
                           flash_attention: bool | None = None, recompute_mode: str | None = None) -> Plan:
    """``plan`` with every stage that recomputes all its layers (``recompute=True``,
    ``recompute_num_layers == 0``, no ``chunk_layers``) given the least N in 1..layers per chunk
    whose memory (perf.predict's, against the device's capacity) fits; N equal to the layers per
    chunk stays 0 (all), as does a stage no N fits. Selective recomputation: ``plan`` unchanged.
    The options mean what they mean to :func:`megatron_het.perf.predict.predict`."""
    if recompute_mode not in (None, "full"):
        return plan
    s_len = model.seq_length if seq_length is None else seq_length
    mbs, v, dp = plan.micro_batch_size, plan.virtual_pipeline_size, len(plan.replicas)
    chosen: dict[tuple[object, ...], int] = {}  # stage signature -> N (0: all)

    def least(island: str, tp: int, num_layers: int, is_first: bool, is_last: bool, in_flight: int) -> int:
        key = (island, tp, num_layers, is_first, is_last, in_flight)
        if key not in chosen:
            device = cluster.island(island).device
            capacity = device_capacity_bytes(device)
            chunk = num_layers // v
            flash = not device.is_host if flash_attention is None else flash_attention
            n_fit = 0
            for n in range(1, chunk):  # memory need not fall monotonically with N: scan upward
                mem = stage_memory(model, num_layers=num_layers, is_first=is_first, is_last=is_last,
                                   micro_batch_size=mbs, microbatches_in_flight=in_flight, tp=tp, dp=dp,
                                   seq_length=s_len, sequence_parallel=plan.sequence_parallel, recompute="full",
                                   distributed_optimizer=plan.use_distributed_optimizer, precision=plan.precision,
                                   flash_attention=flash, virtual_stages=v, recompute_num_layers=n)
                if mem.total_bytes <= capacity:
                    n_fit = n
                    break
            chosen[key] = n_fit
        return chosen[key]

    replicas, changed = [], False
    for r in plan.replicas:
        p, m = len(r.stages), r.num_micro_batches
        stages = []
        for i, st in enumerate(r.stages):
            if st.recompute and not st.recompute_num_layers and not st.chunk_layers and st.num_layers // v > 1:
                in_flight = m if plan.schedule == "gpipe" else microbatches_in_flight(
                    stage=i, pipeline_size=p, num_microbatches=m, virtual_stages=v)
                n = least(st.island, st.tp, st.num_layers, i == 0, i == p - 1, in_flight)
                if n:
                    st, changed = replace(st, recompute_num_layers=n), True
            stages.append(st)
        replicas.append(replace(r, stages=tuple(stages)) if changed else r)
    return replace(plan, replicas=tuple(replicas)) if changed else plan
