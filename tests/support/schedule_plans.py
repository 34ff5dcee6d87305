"""Plans of the schedule parity tests (#16): interleaved (uneven chunks, mixed TP, two replicas) and ZB-H1.

Six ranks, a 6-layer GPT (MODEL6, the parity MODEL with two more layers so chunks can be uneven),
micro-batch 2, global batch 12 (6 micro-batches). ``fast``/``slow`` are CPU islands.
"""

from __future__ import annotations

import dataclasses

from megatron_het.plan import Plan, ReplicaPlan, StagePlan

from support.parity_plans import MICRO_BATCH_SIZE, MODEL

MODEL6 = dataclasses.replace(MODEL, num_layers=6)
GLOBAL_BATCH_SIZE6 = 12
PADDED_VOCAB6 = 512  # 200 padded to a multiple of 128 x lcm(TP sizes = 1, 2, 4)


def _stage(ranks, layers, island="fast", chunks=()) -> StagePlan:
    return StagePlan(island=island, device_type="CPU", ranks=tuple(ranks), layers=layers,
                     chunk_layers=tuple(chunks))


def _plan(replicas, schedule: str, vp: int) -> Plan:
    return Plan(replicas=tuple(ReplicaPlan(stages=tuple(s), num_micro_batches=m) for s, m in replicas),
                micro_batch_size=MICRO_BATCH_SIZE, global_batch_size=GLOBAL_BATCH_SIZE6, schedule=schedule,
                virtual_pipeline_size=vp)


SCHEDULE_CASES = {
    # interleaved v=2, TP4 (fast) -> TP2 (slow), uneven chunks: virtual stages hold 2/1/2/1 layers
    "interleaved_tp4_tp2_uneven": _plan([([_stage(range(0, 4), (0, 4), chunks=((0, 2), (3, 5))),
                                           _stage((4, 5), (4, 6), "slow", chunks=((2, 3), (5, 6)))], 6)],
                                        "interleaved", 2),
    # interleaved v=2, two replicas of different layouts (TP2+TP1 uneven chunks / TP1+TP2 even), 4 vs 2 micro-batches
    "interleaved_two_replicas": _plan([([_stage((0, 1), (0, 4), chunks=((0, 2), (3, 5))),
                                         _stage((2,), (4, 6), "slow", chunks=((2, 3), (5, 6)))], 4),
                                       ([_stage((3,), (0, 2), "slow"), _stage((4, 5), (2, 6))], 2)],
                                      "interleaved", 2),
    # interleaved v=2 over three stages TP1 -> TP1 -> TP4: an odd ring, whose wrap (TP4 -> TP1) is a
    # boundary of its own; each step's transfers batched per neighbour (schedule/transfers.py)
    "interleaved_three_stages": _plan([([_stage((0,), (0, 2), chunks=((0, 1), (3, 4))),
                                         _stage((1,), (2, 4), "slow", chunks=((1, 2), (4, 5))),
                                         _stage(range(2, 6), (4, 6), chunks=((2, 3), (5, 6)))], 6)],
                                      "interleaved", 2),
    # ZB-H1 over three stages TP1 -> TP4 -> TP1, layers 2/3/1
    "zbh1_tp1_tp4_tp1": _plan([([_stage((0,), (0, 2)), _stage(range(1, 5), (2, 5), "slow"),
                                 _stage((5,), (5, 6))], 6)], "zb-h1", 1),
}
