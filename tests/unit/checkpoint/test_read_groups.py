"""A streamed load's groups (checkpoint/dist_ckpt.read_groups): a stage's slots in order, each group's
host buffers (fp32 value + two moments, or the value alone) within the budget, a tensor larger
than the budget alone in its group."""

from __future__ import annotations

import torch

from megatron_het.checkpoint.dist_ckpt import TensorSlot, read_groups


def _slots(*numels):
    return {f"p{i}": TensorSlot(tensor=torch.empty(n, device="meta"), partition_dim=None, tp_rank=0, tp_size=1,
                                main=True) for i, n in enumerate(numels)}


def test_groups_fill_the_budget_in_order():
    slots = _slots(10, 20, 30, 5, 100, 1)
    # 12 bytes per element with the optimizer: a budget of 480 bytes holds 40 elements
    assert read_groups(slots, with_optimizer=True, budget=480) == [["p0", "p1"], ["p2", "p3"], ["p4"], ["p5"]]
    # the value alone: 4 bytes per element, 120 elements
    assert read_groups(slots, with_optimizer=False, budget=480) == [["p0", "p1", "p2", "p3"], ["p4", "p5"]]


def test_everything_fits_one_group_and_nothing_makes_no_group():
    slots = _slots(10, 20, 30)
    assert read_groups(slots, with_optimizer=True, budget=2**30) == [["p0", "p1", "p2"]]
    assert read_groups({}, with_optimizer=True, budget=2**30) == []


def test_an_empty_first_tensor_opens_a_group():
    assert read_groups(_slots(0, 10), with_optimizer=True, budget=480) == [["p0", "p1"]]
