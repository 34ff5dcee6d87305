"""One group per distinct rank set, however many buckets and collection roles (issue #36, item 2).

Each gradient bucket had a process group of its own: on NCCL a communicator per bucket per rank
(~100 for a 7B plan with --overlap-grad-reduce). Now buckets over the same ranks share one group
(``runtime/comm_routing.ReductionGroups``) and start-up prints the count. Two ranks, two replicas of
the whole model, trained once with megatron-core's default bucket size (one bucket) and once with
buckets of 100 parameters (a dozen, counted from the plan here): the same number of communicators.
"""

from __future__ import annotations

import os
import re

import pytest

from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import run_local
from megatron_het.runtime.arguments import parse_args
from megatron_het.runtime.grad_sync import plan_buckets
from megatron_het.runtime.holdings import plan_holdings

from support.paths import REPO
from workers.comm_count_workers import run_logs_worker

PLAN = Plan(replicas=tuple(ReplicaPlan(stages=(StagePlan(island="cpu", device_type="CPU", ranks=(r,), layers=(0, 2)),),
                                       num_micro_batches=1) for r in (0, 1)),
            micro_batch_size=1, global_batch_size=2, precision="fp32")
ARGV = ["--hetero-model", os.path.join(REPO, "examples/models/tiny-cpu.yaml"), "--num-layers", "2",
        "--hetero-cluster", os.path.join(REPO, "examples/clusters/cpu-2.yaml"), "--hetero-plan", "unused",
        "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1", "--mock-data",
        "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1",
        "--overlap-grad-reduce"]
SMALL_BUCKETS = 100
LINE = re.compile(r"communicators per rank: (\d+) \(")


@pytest.mark.multiproc
def test_buckets_over_the_same_ranks_share_one_communicator():
    model = parse_args(ARGV).model
    many = len(plan_buckets(plan_holdings(PLAN, model), bucket_numel=SMALL_BUCKETS))
    one = len(plan_buckets(plan_holdings(PLAN, model), bucket_numel=None))
    assert one == 1 and many > 10, (one, many)
    logs = run_local(2, run_logs_worker, ([ARGV, [*ARGV, "--ddp-bucket-size", str(SMALL_BUCKETS)]], PLAN))
    (default_log, before), (small_log, _) = logs[0]
    counts = [int(LINE.search(log).group(1)) for log in (default_log, small_log)]
    print(f"{one} bucket: {counts[0]} communicators per rank; {many} buckets: {counts[1]} (world alone: {before})")
    # both runs' groups stay registered in the same process: each run adds the same number
    assert counts[1] - counts[0] == counts[0] - before, (counts, before)
    # per run: the one holder set's reduction group and the rank's own group, which all nine of
    # megatron-core's collection roles share on a TP1 stage (runtime/stage_groups.py). Before: 9 grid
    # groups + one reduction group per bucket (9 + 19 with the small buckets).
    assert counts[0] - before == 2, (counts, before)
