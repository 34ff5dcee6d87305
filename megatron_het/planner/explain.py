"""Human explanations: why no plan fits (which constraint, by how much, what would), and why
the chosen plan won."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_het.cluster import ClusterSpec, ModelSpec
from megatron_het.perf.memory import device_capacity_bytes
from megatron_het.perf.predict import Prediction, plan_stage_memory
from megatron_het.plan.types import Plan
from megatron_het.planner.estimate import Estimator
from megatron_het.planner.space import tp_options
from megatron_het.planner.summary import recompute_tag

__all__ = ["island_infeasibility", "describe_plan", "explain_choice", "optimizer_sharding_note"]

_GIB = 2**30


def island_infeasibility(est: Estimator, isl: int, *, max_tp: int, micro_batch_size: int, recompute: bool) -> str:
    """Why ``island`` alone cannot hold the model, e.g. "llama2-70b on 8 x RTX-4090: stage memory
    31.2 GiB > 24 GiB at TP=8, PP=1 even with recompute; needs >= 16 GPUs of 24 GiB"."""
    model, island = est.model, est.cluster.islands[isl]
    L, name = model.num_layers, model.name or "the model"
    tps = tp_options(model, island, max_tp=max_tp)
    head = f"{name} on {island.num_gpus} x {island.device.name} ({island.name})"
    cap_gib = device_capacity_bytes(island.device) / _GIB
    if not tps:
        return (f"{head}: no tensor-parallel size <= {min(max_tp, island.gpus_per_node)} divides "
                f"num_attention_heads={model.num_attention_heads}, num_query_groups={model.num_query_groups} "
                f"and ffn_hidden_size={model.ffn_hidden_size}")
    tp = tps[-1]
    pp = max(1, min(L, island.num_gpus // tp))
    per_stage = -(-L // pp)
    one, slope = est.memory_line(isl, tp, micro_batch_size, recompute, first=True, last=pp == 1, in_flight=pp, dp=1)
    need = (one + (per_stage - 1) * slope) / _GIB
    with_rc = " even with recompute" if recompute else ""
    if need <= cap_gib:
        return f"{head}: fits at TP={tp}, PP={pp} ({need:.1f} GiB <= {cap_gib:g} GiB per GPU)"
    needed = None
    for q in range(pp + 1, L + 1):
        n = -(-L // q)
        o, s = est.memory_line(isl, tp, micro_batch_size, recompute, first=True, last=False, in_flight=q, dp=1)
        if o + (n - 1) * s <= cap_gib * _GIB:
            needed = tp * q
            break
    tail = (f"needs >= {needed} GPUs of {cap_gib:g} GiB" if needed is not None
            else f"even one layer per stage ({one / _GIB:.1f} GiB) does not fit: use GPUs with more memory")
    return (f"{head}: stage memory {need:.1f} GiB > {cap_gib:g} GiB at TP={tp}, PP={pp}{with_rc} "
            f"(micro_batch_size {micro_batch_size}); {tail}")


def describe_plan(plan: Plan) -> str:
    """One line per distinct replica layout: "2 x [a100 TP=2 L0-9 | h100 TP=1 L10-31 RC] m=8,8"
    (RC: the stage recomputes every layer's activations, RC2 only the first 2 layers of each chunk;
    "TP=4 grid [1, 1, 4]": a 3D tensor-parallel stage)."""
    groups: dict[tuple[object, ...], list[int]] = {}
    for r in plan.replicas:
        key = tuple((s.island, s.tp, s.layers, recompute_tag(s), s.tp_grid) for s in r.stages)
        groups.setdefault(key, []).append(r.num_micro_batches)
    lines = []
    for key, ms in groups.items():
        stages = " | ".join(f"{isl} TP={tp}{f' grid {list(g)}' if g else ''} L{a}-{b - 1}{rc}"
                            for isl, tp, (a, b), rc, g in key)
        lines.append(f"{len(ms)} x [{stages}] micro-batches {sorted(set(ms), reverse=True)}")
    return "\n".join(lines)


def explain_choice(model: ModelSpec, cluster: ClusterSpec, ranked: Sequence[tuple[Plan, Prediction]],
                   evaluated: int, pruned: int) -> str:
    best, pred = ranked[0]
    used = pred.num_gpus
    stages = [st for r in best.replicas for st in r.stages]
    recomputing = sum(st.recompute for st in stages)
    rc = ("off" if not recomputing else "on" if recomputing == len(stages)
          else f"on {recomputing} of {len(stages)} stages (where memory needs it)")
    text = [
        f"{model.name or 'model'} on {cluster.num_gpus} GPUs ({', '.join(f'{n} x {d}' for d, n in cluster.gpus_by_device_type().items())}): "
        f"{evaluated} candidate plans priced, {pruned} pruned as infeasible.",
        f"Best: {len(best.replicas)} replica(s), micro_batch_size {best.micro_batch_size}, "
        f"recompute {rc}, {used} GPUs used; predicted "
        f"{pred.iteration_time_s:.4g} s/iteration, {pred.tokens_per_s:.4g} tokens/s, "
        f"{pred.tflops_per_gpu:.4g} TFLOP/s per GPU, peak {pred.memory_gib_per_rank_max:.1f} GiB per rank.",
        describe_plan(best),
        "Layers are split so stages take equal time per micro-batch (faster devices get more layers, "
        "within memory); micro-batches go to replicas in proportion to their throughput.",
    ]
    note = optimizer_sharding_note(best, pred, model, cluster)
    if note:
        text.append(note)
    if len(ranked) > 1:
        gap = ranked[1][1].iteration_time_s / pred.iteration_time_s - 1
        text.append(f"Runner-up is {100 * gap:.2f}% slower.")
    return "\n".join(text)


def optimizer_sharding_note(plan: Plan, pred: Prediction, model: ModelSpec | None = None,
                            cluster: ClusterSpec | None = None) -> str | None:
    """With the plan's distributed optimizer on: which stage fits only because optimizer state is
    sharded over the replicas (the runtime shards it the same way, ``optim/``), else how much it
    saves. None when the plan does not shard optimizer state. An MoE plan with expert parallelism
    (``model``/``cluster`` given) is priced again unsharded: its experts' state is not the sharded part
    times the replicas."""
    if not plan.use_distributed_optimizer:
        return None
    dp = len(plan.replicas)
    worst = None  # (excess bytes without sharding, stage, its prediction)
    saved = 0
    for r, rp in enumerate(pred.replicas):
        for s, st in enumerate(rp.stages):
            if plan.expert_parallel > 1 and model is not None and cluster is not None:
                whole = plan_stage_memory(plan, plan.replicas[r], s, model, cluster, dp=dp, distributed_optimizer=False,
                                          seq_length=model.seq_length)
                full, plain = whole.optimizer_bytes, whole.total_bytes
            else:
                full = st.memory.optimizer_bytes * dp  # stage_memory shards the optimizer part over dp
                plain = st.memory.total_bytes - st.memory.optimizer_bytes + full
            saved = max(saved, full - st.memory.optimizer_bytes)
            excess = plain - st.capacity_gib * _GIB
            if excess > 0 and (worst is None or excess > worst[0]):
                worst = (excess, (r, s), st, plain, full)
    if worst is None:
        return (f"Distributed optimizer: optimizer state sharded over {dp} replicas, up to "
                f"{saved / _GIB:.2f} GiB less per rank; the plan would also fit without it.")
    _, (r, s), st, plain, unsharded = worst
    return (f"Fits only with the distributed optimizer: without it replica {r} stage {s} ({st.island}, TP={st.tp}) "
            f"would need {plain / _GIB:.1f} GiB > {st.capacity_gib:g} GiB (optimizer state "
            f"{unsharded / _GIB:.1f} GiB unsharded); sharded over {dp} replicas it needs "
            f"{st.memory_gib:.1f} GiB.")
