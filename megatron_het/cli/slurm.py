"""Write an sbatch script (Slurm heterogeneous job) that runs a plan on a cluster.

    python tools/slurm.py --cluster examples/clusters/cpu-demo.yaml --plan examples/plans/cpu-demo-hetero.json \
        --partition fast=p0 --partition slow=p1 --output job.sbatch -- --hetero-model examples/models/tiny-cpu.yaml ...

The plan (either kind: pipeline or sharded, as tools/plan.py writes them) is checked against the
cluster and the model first, as pretrain_gpt.py will check it; the model is --model, or the
--hetero-model and Megatron model flags after ``--``. One het-job component per island the plan
uses; one torchrun per node. Everything after ``--`` goes to pretrain_gpt.py after
--hetero-cluster/--hetero-plan. An existing --output is kept unless --force is given. Errors go to
stderr in one line with exit code 2. Guide: docs/launch.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from megatron_het.cluster import load_cluster
from megatron_het.errors import UserError
from megatron_het.launch import (
    DEFAULT_SCRIPT,
    JobOptions,
    LaunchError,
    check_job_flags,
    het_components,
    model_for_job,
    parse_assignments,
    placements_from_options,
    render_sbatch,
)
from megatron_het.plan import PlanError, ShardedPlan, load_any_plan
from megatron_het.utils.atomic import write_text_atomic


def _check_output(path: str, *, force: bool) -> None:
    """Refuse before any work: a directory, a missing parent, or (without --force) an existing file."""
    if os.path.isdir(path):
        raise LaunchError(field="--output", value=path, problem="is a directory",
                          fix="give a file name, e.g. --output job.sbatch")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise LaunchError(field="--output", value=path, problem=f"the directory {parent} does not exist",
                          fix="create it first or write the script elsewhere")
    if os.path.lexists(path) and not force:
        raise LaunchError(field="--output", value=path, problem="the file exists (it is kept)",
                          fix="pass --force to replace it, or choose another --output")


def _memory_check(plan, model, cluster) -> None:
    """The predictor's fit test (what tools/predict.py prints as DOES NOT FIT): refuse the first rank or
    stage whose predicted peak exceeds its device memory."""
    fix = ("re-plan with tools/plan.py (it prices memory), or raise recompute / TP / PP; "
           "tools/predict.py shows every stage's memory")
    if isinstance(plan, ShardedPlan):
        from megatron_het.planner.sharded import predict_sharded

        for r in predict_sharded(plan, model, cluster).ranks:
            if not r.fits:
                raise PlanError(field=f"ranks[{r.rank}]", value=f"{r.memory.total_bytes / 2**30:.3g} GiB",
                                problem=f"does not fit device memory ({r.capacity_bytes / 2**30:.3g} GiB on "
                                        f"island {r.island})", fix=fix)
        return
    from megatron_het.perf.predict import predict

    for ri, rep in enumerate(predict(plan, model, cluster).replicas):
        for si, s in enumerate(rep.stages):
            if not s.fits:
                raise PlanError(field=f"replicas[{ri}].stages[{si}]", value=f"{s.memory_gib:.3g} GiB",
                                problem=f"does not fit device memory ({s.capacity_gib:.3g} GiB per {s.device_type} "
                                        f"on island {s.island})", fix=fix)


def _as_the_job_runs(plan, training_args: list[str]):
    """The plan as pretrain_gpt.py will run it, so the memory check prices what the job holds: the flags
    after ``--`` that change it applied as the entry applies them (--sequence-parallel; precision,
    --use-distributed-optimizer and --overlap-grad-reduce through runtime.plan_record.reconcile_plan,
    whose refusals, e.g. --fp16 on a bf16 plan, then come before the queue too)."""
    if isinstance(plan, ShardedPlan):
        return plan
    from megatron_het.runtime.plan_record import reconcile_plan
    from megatron_het.train.config import TrainConfig

    flags = set(training_args)
    if "--sequence-parallel" in flags:
        plan = dataclasses.replace(plan, sequence_parallel=True)
    train = TrainConfig(micro_batch_size=plan.micro_batch_size, global_batch_size=plan.global_batch_size,
                        train_iters=1, bf16="--bf16" in flags, fp16="--fp16" in flags,
                        overlap_grad_reduce="--overlap-grad-reduce" in flags)
    return reconcile_plan(plan, train, use_distributed_optimizer="--use-distributed-optimizer" in flags)[0]


def _write(path: str, text: str) -> None:
    try:
        write_text_atomic(path, text, mode=0o755)  # executable, as sbatch scripts usually are
    except OSError as e:
        raise LaunchError(field="--output", value=path, problem=f"cannot write: {e.strerror}",
                          fix="choose a writable path") from None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    training_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, training_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="slurm.py", description=__doc__.split("\n")[0])
    parser.add_argument("--cluster", required=True, help="cluster YAML (also passed as --hetero-cluster)")
    parser.add_argument("--plan", required=True, help="plan JSON of either kind (also passed as --hetero-plan)")
    parser.add_argument("--model", default=None,
                        help="model YAML the plan is checked against (default: --hetero-model after --)")
    parser.add_argument("--partition", action="append", default=[], metavar="ISLAND=PARTITION",
                        help="Slurm partition of an island (repeatable)")
    parser.add_argument("--nodelist", action="append", default=[], metavar="ISLAND=NODES",
                        help="Slurm node list of an island, e.g. a100=gpu[00-03] (repeatable)")
    parser.add_argument("--time", default=None, help="time limit, e.g. 02:00:00")
    parser.add_argument("--account", default=None, help="Slurm account")
    parser.add_argument("--job-name", default="megatron-het", help="Slurm job name")
    parser.add_argument("--log", default="%x-%j.out", help="job output file pattern (#SBATCH --output)")
    parser.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: from the job id)")
    parser.add_argument("--script", default=DEFAULT_SCRIPT, help="training entry point torchrun starts")
    parser.add_argument("--output", default=None, help="write the sbatch script here (default: stdout)")
    parser.add_argument("--force", action="store_true", help="replace an existing --output")
    args = parser.parse_args(argv)
    try:
        if args.output:
            _check_output(args.output, force=args.force)
        cluster = load_cluster(args.cluster)
        plan = load_any_plan(args.plan)
        model = model_for_job(training_args, model_file=args.model)
        if model is None:
            raise LaunchError(field="--model", value=None, problem="the plan must be checked against the model",
                              fix="pass --model MODEL.yaml, or --hetero-model MODEL.yaml after --")
        try:
            _as_the_job_runs(plan, training_args).validate(model, cluster, memory_check=_memory_check)
        except PlanError as e:
            raise e.with_file(args.plan) from None
        check_job_flags(training_args, plan, model_file=args.model)
        placements = placements_from_options(cluster, parse_assignments(args.partition, option="--partition"),
                                             parse_assignments(args.nodelist, option="--nodelist"))
        options = JobOptions(cluster_file=args.cluster, plan_file=args.plan, training_args=tuple(training_args),
                             script=args.script, job_name=args.job_name, log=args.log, time=args.time,
                             account=args.account, master_port=args.master_port)
        text = render_sbatch(het_components(cluster, plan, placements), options)
        if args.output:
            _write(args.output, text)
    except UserError as e:
        print(f"slurm.py: {e}", file=sys.stderr)
        return 2
    if args.output:
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
