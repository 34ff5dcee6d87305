"""Plan a training run on a heterogeneous cluster.

    python tools/plan.py --cluster examples/clusters/a100-h100.yaml --model examples/models/llama2-7b.yaml \
        --global-batch-size 256 --output plan.json

Prints the top plans and writes the best one (with "predicted") for pretrain_gpt.py --hetero-plan.
Errors (infeasible, bad files, absurd sizes) are one line on stderr with exit code 2; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_het.cli.output import check_output_file, quiet_on_broken_pipe
from megatron_het.cli.profiles import warn_unused_profiles
from megatron_het.cluster import load_cluster, load_model
from megatron_het.errors import UserError
from megatron_het.perf import load_profile
from megatron_het.perf.bounds import check_global_batch_size
from megatron_het.plan.types import DEFAULT_PRECISION, PLAN_ATTENTIONS, PLAN_PRECISIONS
from megatron_het.planner import MODES, plan_best, with_seq_length
from megatron_het.planner.parallelizer import AxonnParallelizer
from megatron_het.planner.summary import (
    candidates_table,
    expert_placement,
    rank_ranges,
    summarize_plan,
    summarize_sharded,
)
from megatron_het.utils.progress import Progress, add_progress_argument


@quiet_on_broken_pipe
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plan.py", description=__doc__.split("\n")[0])
    parser.add_argument("--cluster", required=True, help="cluster YAML")
    parser.add_argument("--model", required=True, help="model YAML")
    parser.add_argument("--global-batch-size", type=int, required=True, help="sequences per iteration")
    parser.add_argument("--seq-length", type=int, default=None, help="override the model's seq_length")
    parser.add_argument("--profile", action="append", default=[], help="profile JSON (repeatable, one per device)")
    parser.add_argument("--top", type=int, default=5, help="plans to show")
    parser.add_argument("--exhaustive", action="store_true", help="search the full space (small clusters)")
    parser.add_argument("--json", action="store_true", help="print the top plans as a JSON list")
    parser.add_argument("--verbose", action="store_true",
                        help="list every replica (or sharded rank), whole table rows and every pruning reason; "
                             "by default identical replicas are listed once with a count and ranks as ranges")
    parser.add_argument("--output", default=None, help="write the best plan here")
    parser.add_argument("--mode", choices=("auto", *MODES), default="auto",
                        help="plan family: the pipeline search, uneven sharded data parallelism (Cephalo), or "
                             "the faster of the two (auto, default)")
    parser.add_argument("--tp-3d", action="store_true",
                        help="pipeline plans may give a stage an AxoNN 3D tensor-parallel grid (tp_grid) where the "
                             "4D communication model says it beats 1D TP; plans without the distributed optimizer, "
                             "which 3D stages do not run yet")
    parser.add_argument("--precision", choices=PLAN_PRECISIONS, default=DEFAULT_PRECISION,
                        help="training precision the plans are priced at and record (pretrain_gpt.py trains in what "
                             f"the plan records; Megatron: no flag = fp32, --bf16, --fp16); default {DEFAULT_PRECISION}")
    parser.add_argument("--attention", choices=PLAN_ATTENTIONS, default=None,
                        help="the attention kernel the plans are priced with and record: fused (flash: "
                             "transformer-engine or torch SDPA) or unfused (megatron-core's DotProductAttention, "
                             "s x s scores held); default: fused on GPUs, unfused on CPUs. Pipeline plans only")
    parser.add_argument("--expert-model-parallel-size", type=int, default=None, metavar="EP",
                        help="MoE: plan at this expert parallelism (Megatron-LM's flag; expert-TP = each stage's "
                             "TP); default: the planner searches every EP dividing --num-experts and keeps the fastest")
    add_progress_argument(parser)
    args = parser.parse_args(argv)
    if args.attention is not None and args.mode == "sharded":
        parser.error("--attention prices pipeline plans (sharded plans price the default kernel); drop it or use "
                     "--mode pipeline")
    if args.top < 1:
        parser.error(f"--top must be >= 1 (plans to show), got {args.top}")
    try:
        check_global_batch_size(args.global_batch_size, field="--global-batch-size")
        if args.output:
            check_output_file(args.output, flag="--output")
        model, cluster = load_model(args.model), load_cluster(args.cluster)
        profiles = [load_profile(p) for p in args.profile] or None
        warn_unused_profiles(profiles, with_seq_length(model, args.seq_length), cluster, prog="plan.py")
        pipeline_options = {"top_k": args.top, "exhaustive": args.exhaustive, "precision": args.precision,
                            **({} if args.attention is None else {"attention": args.attention}),
                            **({} if args.expert_model_parallel_size is None
                               else {"expert_parallel": args.expert_model_parallel_size})}
        # the sharded mode knows two state layouts: fp32 weights, or 16-bit weights with fp32 state
        sharded_options = {"precision": args.precision}  # stored and computed as the run's precision
        if args.tp_3d:  # the per-island parallelizer that offers 3D grids (docs/planner.md)
            pipeline_options.update(distributed_optimizer=False, parallelizer=AxonnParallelizer(
                with_seq_length(model, args.seq_length), cluster, profile=profiles, distributed_optimizer=False,
                attention=args.attention, expert_parallel=args.expert_model_parallel_size or 1))
        bar = Progress("plan: search", unit="candidates", quiet=args.no_progress)
        try:
            choice = plan_best(model, cluster, global_batch_size=args.global_batch_size, seq_length=args.seq_length,
                               profile=profiles,
                               # --attention: pipeline plans (the sharded mode prices the default kernel)
                               modes=(("pipeline",) if args.attention is not None else MODES) if args.mode == "auto"
                               else (args.mode,),
                               sharded_options=sharded_options,
                               pipeline_options={**pipeline_options, "progress": bar.update})
        except UserError:
            bar.quiet = True  # the error line is the whole report
            raise
        finally:
            bar.close()
    except UserError as err:  # bugs are not caught: they surface as tracebacks
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = choice.pipeline_result
    if args.output:  # before printing: a reader closing the pipe (plan.py ... | head) must not lose the plan
        choice.plan.save(args.output)
    if args.json:  # the chosen mode's plans, best first
        plans = ([plan.to_dict() for plan, _ in result.candidates] if choice.mode == "pipeline"
                 else [choice.plan.to_dict()])
        print(json.dumps(plans, indent=2))
    else:
        if result is not None:
            print("\n".join(candidates_table(result.candidates, verbose=args.verbose)))
            print()
            print(result.explanation)
            if args.verbose:
                print("\n".join(summarize_plan(result.best, verbose=True)))
                print("\n".join(f"pruned: {r}" for r in result.infeasible))
            else:
                print("ranks: " + "; ".join(f"{isl} {rank_ranges(r)}" for isl, r in result.best.island_ranks().items()))
            if model.is_moe and result.best.expert_parallel > 1:
                print(expert_placement(result.best, model.num_experts))
        if choice.sharded is not None:
            print("\n".join(summarize_sharded(choice.sharded, verbose=args.verbose)))
        print(f"mode: {choice.explanation}")
    if args.output and not args.json:
        print(f"wrote {args.output}")
    return 0
