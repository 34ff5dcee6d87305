"""Readable plan listings: identical replicas once with a count, ranks as ranges, sharded plans by
island and share; short by default (a screenful for any cluster size), everything when verbose."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from megatron_het.perf.predict import Prediction
from megatron_het.plan.types import Plan

if TYPE_CHECKING:  # annotations only: listing a sharded plan needs no import of the sharding package
    from megatron_het.sharding.plan import ShardedPlan

__all__ = ["candidates_table", "rank_ranges", "summarize_plan", "summarize_sharded"]

GROUPS_SHOWN = 8  # layouts listed by default; the rest are counted ("--verbose" lists them)
LINE_CHARS = 160  # default cut of a table row; verbose rows are whole


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [r]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def recompute_tag(stage) -> str:
    """" RC" when the stage recomputes every layer, " RC2" when only the first 2 layers of each model
    chunk recompute (Megatron's block method), "" when it does not recompute."""
    if not stage.recompute:
        return ""
    return f" RC{stage.recompute_num_layers}" if stage.recompute_num_layers else " RC"


def _layout_groups(plan: Plan) -> list[tuple[tuple[tuple[str, int, tuple[int, int], str], ...], list[int]]]:
    """(stage key per stage, replica indices) per distinct layout, in first-use order."""
    groups: dict[tuple[tuple[str, int, tuple[int, int], str], ...], list[int]] = {}
    for i, r in enumerate(plan.replicas):
        groups.setdefault(tuple((s.island, s.tp, s.layers, recompute_tag(s)) for s in r.stages), []).append(i)
    return list(groups.items())


def _layout_text(key: Sequence[tuple[str, int, tuple[int, int], str]]) -> str:
    return " | ".join(f"{isl} TP={tp} L{a}-{b - 1}{rc}" for isl, tp, (a, b), rc in key)


def summarize_plan(plan: Plan, *, verbose: bool = False) -> list[str]:
    """Header, then one line per distinct replica layout (count, stages, micro-batches, ranks per
    island as ranges); at most GROUPS_SHOWN layouts unless ``verbose``, which also lists every replica."""
    groups = _layout_groups(plan)
    islands = plan.island_ranks()
    lines = [f"plan: {len(plan.replicas)} replica(s) in {len(groups)} layout(s), {plan.world_size} ranks "
             f"({', '.join(f'{isl} {len(r)}' for isl, r in islands.items())}), micro-batch {plan.micro_batch_size}, "
             f"global batch {plan.global_batch_size}, schedule {plan.schedule}"]
    shown = groups if verbose else groups[:GROUPS_SHOWN]
    for key, idx in shown:
        ms = sorted({plan.replicas[i].num_micro_batches for i in idx}, reverse=True)
        by_island: dict[str, list[int]] = {}
        for i in idx:
            for s in plan.replicas[i].stages:
                by_island.setdefault(s.island, []).extend(s.ranks)
        ranks = "; ".join(f"{isl} {rank_ranges(r)}" for isl, r in by_island.items())
        lines.append(f"  {len(idx)} x [{_layout_text(key)}] micro-batches {'/'.join(map(str, ms))}; ranks {ranks}")
    if len(shown) < len(groups):
        rest = sum(len(idx) for _, idx in groups[len(shown):])
        lines.append(f"  ... {len(groups) - len(shown)} more layout(s), {rest} replica(s) (--verbose lists them)")
    if verbose:
        lines += plan.describe()[1:]
    return lines


def expert_placement(plan: Plan, num_experts: int) -> str:
    """Where an MoE plan's routed experts sit, per island: its expert grids (plan/experts.py), how many
    ranks each spans and experts each rank holds per MoE layer; "" with experts replicated (EP 1)."""
    from megatron_het.plan.experts import stage_expert_grids

    if plan.expert_parallel == 1:
        return ""
    owner = {r: s.island for rep in plan.replicas for s in rep.stages for r in s.ranks}
    grids: dict[str, list[int]] = {}
    for ranks, _ in stage_expert_grids([[s.ranks for s in r.stages] for r in plan.replicas],
                                       ep=plan.expert_parallel, etp=plan.expert_tensor_parallel):
        grids.setdefault(owner[ranks[0]], []).append(len(ranks))
    etp = "each stage's TP" if plan.expert_tensor_parallel is None else str(plan.expert_tensor_parallel)
    per_island = "; ".join(f"{isl}: {len(sizes)} grid(s) of {'/'.join(map(str, sorted(set(sizes))))} ranks"
                           for isl, sizes in grids.items())
    return (f"experts: EP {plan.expert_parallel}, expert-TP {etp}: each rank holds {num_experts // plan.expert_parallel}"
            f" of the {num_experts} experts of its MoE layers; {per_island}")


def summarize_sharded(plan: ShardedPlan, *, verbose: bool = False) -> list[str]:
    """Header, then per island the ranks grouped by (micro-batches, share, recompute) as ranges;
    ``verbose`` adds the plan's own per-rank listing."""
    lines = [f"sharded plan: {len(plan.ranks)} ranks, global batch {plan.global_batch_size}"]
    groups: dict[tuple[str, str, int, int, float, bool], list[int]] = {}
    for r in plan.ranks:
        key = (r.island, r.device_type, r.micro_batch_size, r.num_micro_batches, round(r.shard_fraction, 6), r.recompute)
        groups.setdefault(key, []).append(r.rank)
    for (isl, dev, mbs, m, share, rc), ranks in groups.items():
        lines.append(f"  {isl} ({dev}): ranks {rank_ranges(ranks)} ({len(ranks)}): {m} x {mbs} samples, "
                     f"state share {100 * share:.3g}% each{', recompute' if rc else ''}")
    if verbose:
        lines += list(plan.describe())
    return lines


def _schedule_text(plan: Plan) -> str:
    return plan.schedule + (f" v={plan.virtual_pipeline_size}" if plan.virtual_pipeline_size > 1 else "")


def plan_form(plan: Plan) -> str:
    """Schedule and gradient reduction in a few words, e.g. ``zb-h1, overlap``."""
    return f"{_schedule_text(plan)}, {_grads_text(plan)}"


def _grads_text(plan: Plan) -> str:
    """How the plan reduces gradients across replicas: the rows of one layout differ only here."""
    if plan.use_distributed_optimizer:  # sharded optimizer state; reduce-scatter after the backward, or
        return "dopt+ovl" if plan.overlap_grad_reduce else "dist-opt"  # all-reduce buckets within it
    return "overlap" if plan.overlap_grad_reduce else "sync"


def candidates_table(candidates: Sequence[tuple[Plan, Prediction]], *, verbose: bool = False) -> list[str]:
    """One row per candidate plan: predictions and its layouts, grouped; rows cut at LINE_CHARS
    unless ``verbose``."""
    rows = ["rank  iter_s      tokens/s    TFLOP/s/GPU  mem_GiB  mbs  GPUs   schedule     grads    "
            "layouts: count x [stages] m=micro-batches"]
    for n, (plan, pred) in enumerate(candidates, 1):
        desc = "; ".join(
            f"{len(idx)} x [{_layout_text(key)}] m="
            + "/".join(str(m) for m in sorted({plan.replicas[i].num_micro_batches for i in idx}, reverse=True))
            for key, idx in _layout_groups(plan))
        row = (f"{n:<5} {pred.iteration_time_s:<11.4g} {pred.tokens_per_s:<11.4g} {pred.tflops_per_gpu:<12.4g} "
               f"{pred.memory_gib_per_rank_max:<8.1f} {plan.micro_batch_size:<4} {pred.num_gpus:<6} "
               f"{_schedule_text(plan):<12} {_grads_text(plan):<8} {desc}")
        rows.append(row if verbose or len(row) <= LINE_CHARS else row[:LINE_CHARS - 3] + "...")
    return rows
