"""Every group the runtime builds gets the run's one timeout (#21 item 9): torch gives a new group
its own 30-minute default whatever the world group has, so the builders pass it explicitly."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from megatron_het.plan import homogeneous_plan

from support.one_rank import one_rank_world

RUN = datetime.timedelta(seconds=123)  # the run's timeout (--distributed-timeout-minutes)
WORLD = datetime.timedelta(seconds=77)


def _timeout(group) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


@pytest.fixture
def world():
    with one_rank_world(WORLD):
        yield


def test_torch_default_is_not_the_world_timeout(world):
    """Why the builders must pass it (this test fails the day torch inherits the world's timeout)."""
    assert _timeout(dist.new_group([0])) == datetime.timedelta(minutes=30) != WORLD


def test_block_groups_take_the_run_timeout(world):
    from megatron_het.model.groups import BlockShape, block_process_groups

    _, pgc = block_process_groups(BlockShape(tp=1, pp=1, dp=1), timeout=RUN)
    groups = {name: getattr(pgc, name) for name in ("tp", "pp", "dp", "cp", "ep", "mp", "tp_cp", "dp_cp",
                                                     "tp_dp_cp", "embd", "pos_embd")}
    assert {name: _timeout(g) for name, g in groups.items()} == {name: RUN for name in groups}


def test_stage_and_reduction_groups_take_the_run_timeout(world):
    from megatron_het.runtime.comm_routing import new_reduction_group, rank_placement
    from megatron_het.runtime.stage_groups import build_stage_groups

    plan = homogeneous_plan(tp=1, pp=1, dp=1, num_layers=2, micro_batch_size=1, global_batch_size=1,
                            island="a", device_type="CPU")
    pgc, _ = build_stage_groups(plan, timeout=RUN)
    assert {_timeout(pgc.tp), _timeout(pgc.dp), _timeout(pgc.mp)} == {RUN}
    from megatron_het.platform import detect_accelerator

    group = new_reduction_group([0], rank_placement(plan, None), accelerator=detect_accelerator(), timeout=RUN)
    assert _timeout(group.group) == RUN


def test_bad_timeout_is_refused():
    from megatron_het.model.groups import group_options

    assert group_options(None) == {}
    with pytest.raises(ValueError, match=r"timeout: must be a positive datetime.timedelta \(got 600\)"):
        group_options(600)
