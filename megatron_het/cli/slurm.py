"""Write an sbatch script (Slurm heterogeneous job) that runs a plan on a cluster.

    python tools/slurm.py --cluster examples/clusters/cpu-demo.yaml --plan examples/plans/cpu-demo-hetero.json \
        --partition fast=p0 --partition slow=p1 --output job.sbatch -- --num-layers 4 ...

One het-job component per island the plan uses; one torchrun per node. Everything after ``--``
goes to pretrain_gpt.py after --hetero-cluster/--hetero-plan. Errors go to stderr with exit code 1.
Guide: docs/launch.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from megatron_het.cluster import ConfigError, load_cluster
from megatron_het.launch import (
    DEFAULT_SCRIPT,
    JobOptions,
    LaunchError,
    het_components,
    parse_assignments,
    placements_from_options,
    render_sbatch,
)
from megatron_het.plan import Plan, PlanError


def _write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".sbatch-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    training_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, training_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="slurm.py", description=__doc__.split("\n")[0])
    parser.add_argument("--cluster", required=True, help="cluster YAML (also passed as --hetero-cluster)")
    parser.add_argument("--plan", required=True, help="plan JSON (also passed as --hetero-plan)")
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
    args = parser.parse_args(argv)
    try:
        cluster = load_cluster(args.cluster)
        plan = Plan.load(args.plan)
        placements = placements_from_options(cluster, parse_assignments(args.partition, option="--partition"),
                                             parse_assignments(args.nodelist, option="--nodelist"))
        options = JobOptions(cluster_file=args.cluster, plan_file=args.plan, training_args=tuple(training_args),
                             script=args.script, job_name=args.job_name, log=args.log, time=args.time,
                             account=args.account, master_port=args.master_port)
        text = render_sbatch(het_components(cluster, plan, placements), options)
    except (ConfigError, PlanError, LaunchError) as e:
        print(f"slurm.py: {e}", file=sys.stderr)
        return 1
    if args.output:
        _write_atomically(args.output, text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
