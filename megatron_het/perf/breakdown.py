"""Where a predicted iteration goes: the critical stage's compute by kind, exposed communication, bubble.

The iteration's critical path runs through the slowest replica; its busiest stage is the one to
explain. That stage's busy time over the iteration is split by what its micro-batches spend on
(from the analytic compute model's parts: GEMMs by kind, fused attention, element-wise work, fp8
casts, per-kernel fixed costs, recomputation; measured layer times when a profile has them), plus
its exposed tensor-parallel traffic. The rest of the iteration is pipeline bubble and p2p waits
(pipeline time minus that stage's busy time), the gradient reduction past the pipeline's end and the
optimizer step; the parts add up to the predicted iteration time.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_het.cluster import ClusterSpec, ModelSpec
from megatron_het.perf.calibrate import with_measured_links
from megatron_het.perf.compute import embedding_times, layer_times, logits_times
from megatron_het.perf.memory import activation_element_bytes
from megatron_het.perf.predict import Prediction, expert_channels, moe_dispatch_extra, predict, profile_for, stage_cost
from megatron_het.perf.profile import Profile
from megatron_het.plan.types import Plan

__all__ = ["explain", "PART_LABELS"]

PART_LABELS = {
    "gemm:qkv": "GEMM QKV", "gemm:attention": "GEMM attention core (unfused)", "attention": "fused attention",
    "gemm:projection": "GEMM attention projection", "gemm:fc1": "GEMM MLP fc1", "gemm:fc2": "GEMM MLP fc2",
    "gemm:logits": "GEMM logits", "elementwise": "element-wise (norms, residuals, activation, loss)",
    "fp8_casts": "fp8 casts", "kernel_overhead": "per-kernel fixed costs", "recompute": "recomputation",
    "measured": "measured layer time (profile)", "tp_communication": "tensor-parallel communication (exposed)",
    "moe_dispatch": "MoE token dispatch (EP all-to-all, expert-TP gathers; modelled beyond measured layers)",
    "bubble": "pipeline bubble and p2p waits", "gradient_reduction": "gradient reduction (exposed)",
    "synchronization": "per-iteration all-reduces (grad norm, loss)",
    "optimizer": "optimizer step",
}


def explain(plan: Plan, model: ModelSpec, cluster: ClusterSpec, *, profile: Profile | Sequence[Profile] | None = None,
            prediction: Prediction | None = None, **predict_kwargs) -> tuple[Prediction, dict[str, float]]:
    """The prediction and its breakdown: part -> seconds per iteration (summing to the iteration)."""
    pred = prediction or predict(plan, model, cluster, profile=profile, **predict_kwargs)
    ri = max(range(len(pred.replicas)), key=lambda i: pred.replicas[i].pipeline_time_s)
    replica, rp = plan.replicas[ri], pred.replicas[ri]
    si = max(range(len(rp.stages)), key=lambda i: rp.stages[i].compute_s)
    st, sp = replica.stages[si], rp.stages[si]
    is_first, is_last = si == 0, si == len(replica.stages) - 1
    device = cluster.island(st.island).device
    measured = profile_for(profile, device.name, st.island)
    flash = predict_kwargs.get("flash_attention")
    flash = not device.is_host if flash is None else flash
    mode = (predict_kwargs.get("recompute_mode") or "full") if st.recompute else "none"
    args = dict(micro_batch_size=plan.micro_batch_size, seq_length=predict_kwargs.get("seq_length"), tp=st.tp,
                profile=measured, precision=plan.precision)
    n = st.num_layers
    # layers that recompute and layers that do not (Megatron's block method: recompute_num_layers)
    counts = {mode: st.recomputed_layers(plan.virtual_pipeline_size) if st.recompute else 0}
    counts["none"] = counts.get("none", 0) + n - counts[mode]
    k = cluster.slowdown(st.island)
    parts: dict[str, float] = {}

    def add(name: str, seconds: float) -> None:
        parts[name] = parts.get(name, 0.0) + seconds

    linked = with_measured_links(cluster, profile)  # the links predict() prices
    island = linked.island(st.island)
    etp = st.tp if plan.expert_tensor_parallel is None else plan.expert_tensor_parallel
    ep_channel = expert_channels(plan, linked).get(st.ranks[0]) if model.is_moe else None
    ep_entry = plan.expert_parallel if etp == 1 else 1  # the profile entry stage_cost looks up
    layers_s = dispatch_s = 0.0
    for m, count in counts.items():
        lt = layer_times(model, device, sequence_parallel=plan.sequence_parallel, recompute=m, flash_attention=flash,
                         ep=ep_entry, **args)
        for name, sec in (lt.parts.items() if lt.parts else [("measured", lt.forward_s + lt.backward_s)]):
            add(name, k * count * sec)
        layers_s += k * count * (lt.forward_s + lt.backward_s)
        if model.is_moe:  # what stage_cost adds for the token dispatcher beyond the layer's own times
            d = moe_dispatch_extra(model, island, lt, micro_batch_size=plan.micro_batch_size, tp=st.tp,
                                   ep=plan.expert_parallel, etp=etp, ep_channel=ep_channel,
                                   seq_length=predict_kwargs.get("seq_length"),
                                   sequence_parallel=plan.sequence_parallel, recompute=m,
                                   element_bytes=activation_element_bytes(plan.precision))
            dispatch_s += k * count * sum(d)
    cost = stage_cost(model, island, tp=st.tp, micro_batch_size=plan.micro_batch_size,
                      seq_length=predict_kwargs.get("seq_length"), slowdown=cluster.slowdown(st.island),
                      recompute=mode, sequence_parallel=plan.sequence_parallel, tp_comm_overlap=st.tp_comm_overlap,
                      profile=profile, precision=plan.precision, flash_attention=flash,
                      recompute_share=counts[mode] / n if mode != "none" else 1.0, ep=plan.expert_parallel,
                      ep_channel=ep_channel, etp=plan.expert_tensor_parallel)
    add("tp_communication", n * (cost.layer_forward_s + cost.layer_backward_s) - layers_s - dispatch_s)
    add("moe_dispatch", dispatch_s)
    if is_first:
        e = embedding_times(model, device, **args)
        for name, sec in (e.parts.items() if e.parts else [("measured", e.forward_s + e.backward_s)]):
            add(name, k * sec)
    if is_last:
        o = logits_times(model, device, **args)
        for name, sec in (o.parts.items() if o.parts else [("measured", o.forward_s + o.backward_s)]):
            add(name, k * sec)
    per_micro_batch = sum(parts.values())
    scale = sp.compute_s / per_micro_batch if per_micro_batch > 0 else 0.0
    out = {name: sec * scale for name, sec in parts.items() if abs(sec) > 0}
    out["bubble"] = max(0.0, pred.pipeline_time_s - sp.compute_s)
    out["gradient_reduction"] = pred.gradient_reduction_s
    out["synchronization"] = pred.synchronization_s
    out["optimizer"] = pred.optimizer_s
    return pred, out
