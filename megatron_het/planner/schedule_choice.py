"""Which pipeline schedule a plan runs: every schedule the runtime implements, priced, the fastest kept (#16).

The search ranks layouts under 1F1B; the chosen layout is then priced under ZB-H1 (split backward:
W fills the cool-down bubble) and interleaved 1F1B with two model chunks per stage (each stage's
layers in two equal chunks, so chunks differ across stages as the stages' layer counts do; needs >= 2
stages, an even layer count per stage, which the memory model prices, and micro-batch counts that are
multiples of the stage count). A variant must validate and fit memory;
the fastest wins, 1F1B on ties. The sentence returned says what was chosen and the alternatives' times.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from megatron_het.cluster import ClusterSpec, ModelSpec
from megatron_het.perf.predict import Prediction
from megatron_het.plan.errors import PlanError
from megatron_het.plan.layout import uneven_chunk_layers
from megatron_het.plan.types import Plan
from megatron_het.plan.validate import validate_plan

__all__ = ["INTERLEAVED_CHUNKS", "choose_schedule", "schedule_variants"]

INTERLEAVED_CHUNKS = 2  # model chunks per stage the planner prices for interleaving


def schedule_variants(plan: Plan) -> dict[str, Plan | str]:
    """Schedule label -> the plan under that schedule, or why the runtime cannot run it for this layout."""
    out: dict[str, Plan | str] = {"1f1b": replace(plan, schedule="1f1b", virtual_pipeline_size=1)}
    out["zb-h1"] = replace(plan, schedule="zb-h1", virtual_pipeline_size=1)
    v = INTERLEAVED_CHUNKS
    label = f"interleaved v={v}"
    replicas = []
    for r in plan.replicas:
        p = len(r.stages)
        if p < 2:
            out[label] = "a replica has one stage"
            return out
        if r.num_micro_batches % p:
            out[label] = f"a replica's {r.num_micro_batches} micro-batches are not a multiple of its {p} stages"
            return out
        odd = next((st for st in r.stages if st.num_layers % v), None)
        if odd is not None:  # perf/memory.stage_memory prices equal chunks within a stage
            out[label] = f"a stage's {odd.num_layers} layers do not split into {v} equal chunks"
            return out
        counts = [[st.num_layers // v] * v for st in r.stages]
        chunks = uneven_chunk_layers(counts)
        replicas.append(replace(r, stages=tuple(replace(st, chunk_layers=c) for st, c in zip(r.stages, chunks))))
    out[label] = replace(plan, schedule="interleaved", virtual_pipeline_size=v, replicas=tuple(replicas))
    return out


def choose_schedule(best: tuple[Plan, Prediction], model: ModelSpec, cluster: ClusterSpec, *,
                    predict_plan: Callable[[Plan], Prediction],
                    refine: Callable[[tuple[Plan, Prediction]], tuple[Plan, Prediction]] | None = None,
                    ) -> tuple[tuple[Plan, Prediction], str]:
    """The fastest runnable schedule for ``best``'s layout (its prediction attached) and a sentence why.

    ``refine`` (the planner's least block recomputation) is applied to every schedule's plan before
    they are compared: a schedule whose activations need more recomputation under full recompute may
    need less once trimmed, so trimming only the winner could keep the wrong schedule."""
    plan, pred = best
    priced: dict[str, tuple[Plan, Prediction]] = {"1f1b": (plan, pred)} if plan.schedule == "1f1b" else {}
    refused: dict[str, str] = {}
    for label, variant in schedule_variants(plan).items():
        if label in priced:
            continue
        if isinstance(variant, str):
            refused[label] = variant
            continue
        try:
            validate_plan(variant, model, cluster)
        except PlanError as err:
            refused[label] = str(err).splitlines()[0]
            continue
        p = predict_plan(variant)
        if not p.fits:
            refused[label] = f"predicted memory {p.memory_gib_per_rank_max:.1f} GiB exceeds a device"
            continue
        priced[label] = (replace(variant, predicted=p.to_json_dict()), p)
    untrimmed = {k: v[1].iteration_time_s for k, v in priced.items()}
    if refine is not None:
        priced = {k: refine(v) for k, v in priced.items()}
    order = list(priced)  # 1f1b first: it wins ties
    chosen = min(order, key=lambda k: (priced[k][1].iteration_time_s, order.index(k)))
    t0 = priced[chosen][1].iteration_time_s
    others = ", ".join(f"{k} {priced[k][1].iteration_time_s:.4g} s ({100 * (priced[k][1].iteration_time_s / t0 - 1):+.1f}%, "
                       f"bubble {priced[k][1].replicas[0].bubble_fraction:.0%})" for k in order if k != chosen)
    why = {"1f1b": "the others do not shorten this layout's iteration",
           "zb-h1": "deferring weight gradients (W) fills the pipeline's cool-down bubble",
           }.get(chosen, "two model chunks per stage shrink the warm-up/cool-down bubble")
    text = (f"Schedule: {chosen}, predicted {t0:.4g} s/iteration with bubble "
            f"{priced[chosen][1].replicas[0].bubble_fraction:.0%} ({why})"
            + (f"; priced also: {others}" if others else "")
            + "".join(f"; {k} not possible: {r}" for k, r in refused.items()) + ".")
    if t0 < untrimmed[chosen]:
        text += (f" Block recomputation (the least that fits) instead of full: predicted {t0:.4g} s/iteration "
                 f"({untrimmed[chosen]:.4g} s with every layer recomputed).")
    return priced[chosen], text
