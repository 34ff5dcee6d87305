"""Buckets sharing one group are launched in bucket order, whatever order each rank's backward
completes them (issue #36: buckets over the same ranks now share one group, and a group's
collectives must be issued in one order on every member).

Two ranks, six one-tensor buckets over both (one shared group); rank 0's hooks complete them last
bucket first, rank 1's first bucket first. Launching as completed (the code before) issued the
all-reduces in opposite orders: on gloo, bucket i of rank 0 was summed with bucket 5 - i of rank 1
(equal sizes, silently wrong); on NCCL a hang or the same. Now both ranks launch 0..5, all during the
backward on rank 1 and once the last-completed bucket arrives on rank 0, and each sum is its own.
"""

from __future__ import annotations

import pytest

from megatron_het.platform.local_launch import run_local

from workers.overlap_workers import launch_order_worker

COUNT = 6


@pytest.mark.multiproc
def test_a_shared_groups_buckets_launch_in_bucket_order_on_every_rank():
    results = run_local(2, launch_order_worker, (COUNT,))
    for launched, in_backward, groups, sums in results:
        assert groups == 1
        assert launched == list(range(COUNT)) and in_backward == COUNT
        assert sums == {i: 101.0 * (1 + i) for i in range(COUNT)}  # rank 0's (1 + i) plus rank 1's 100 (1 + i)
