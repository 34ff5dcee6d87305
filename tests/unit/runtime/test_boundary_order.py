"""Boundary messages matched by order (issue 14): NCCL/RCCL ignore p2p tags, so neighbour stages
must post their transfers in the same micro-batch order; ``order_mismatches`` says where they do not."""

from __future__ import annotations

from megatron_het.runtime.boundary import order_mismatches
from megatron_het.schedule import Action, build_schedule


def test_generated_schedules_match_by_order():
    for name in ("1f1b", "gpipe", "zb-h1"):
        for stages, micro in ((2, 3), (3, 5), (4, 8)):
            assert order_mismatches(build_schedule(name, stages, micro).actions) == [], (name, stages, micro)


def test_a_reordered_stage_is_reported():
    up = (Action(kind="F", micro_batch=0), Action(kind="F", micro_batch=1),
          Action(kind="B", micro_batch=0), Action(kind="B", micro_batch=1))
    down = (Action(kind="F", micro_batch=1), Action(kind="F", micro_batch=0),
            Action(kind="B", micro_batch=1), Action(kind="B", micro_batch=0))
    found = order_mismatches([up, down])
    assert len(found) == 2 and "stage 0 sends activations in order [0, 1], stage 1 receives [1, 0]" in found[0]
