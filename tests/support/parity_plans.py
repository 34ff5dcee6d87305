"""The heterogeneous parity plans: one definition for the fp32, mixed-precision and checkpoint tests.

Eight ranks, a 4-layer GPT (MODEL), micro-batch 2 and global batch 8; each plan is named by its
shape. Islands ``fast``/``slow`` are CPU; ``nv``/``amd`` (BRIDGED_CLUSTER) are an emulated A100 +
MI250X pair whose cross-vendor groups must go through the het bridge.
"""

from __future__ import annotations

from megatron_het.cluster import ModelSpec
from megatron_het.plan import Plan, ReplicaPlan, StagePlan

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=200)
MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE = 2, 8
PADDED_VOCAB = 512  # 200 padded to a multiple of 128 x lcm(TP sizes = 1, 2, 4)


def stage(ranks, layers, island="fast", device="CPU") -> StagePlan:
    return StagePlan(island=island, device_type=device, ranks=tuple(ranks), layers=layers)


def plan(*replicas) -> Plan:
    """``plan(([stage, ...], num_micro_batches), ...)`` at the shared batch sizes."""
    return Plan(replicas=tuple(ReplicaPlan(stages=tuple(s), num_micro_batches=m) for s, m in replicas),
                micro_batch_size=MICRO_BATCH_SIZE, global_batch_size=GLOBAL_BATCH_SIZE)


CASES = {
    # (a) three stages, TP 2 -> 4 -> 2, uneven layers 1/2/1
    "tp2pp1_tp4pp1_tp2pp1": plan(([stage([0, 1], (0, 1)), stage([2, 3, 4, 5], (1, 3), "slow"),
                                   stage([6, 7], (3, 4))], 4)),
    # (b) two replicas of different layouts (PP2xTP2 vs PP1xTP4) with 3 vs 1 micro-batches
    "pp2tp2x3_pp1tp4x1": plan(([stage([0, 1], (0, 3)), stage([2, 3], (3, 4))], 3),
                              ([stage([4, 5, 6, 7], (0, 4), "slow")], 1)),
    # (c) TP 1 -> 2 boundaries with tied embeddings (first stage TP1, last TP2), three replicas
    "tp1_tp2_tied_x3": plan(([stage([0], (0, 2)), stage([1, 2], (2, 4))], 2),
                            ([stage([3], (0, 1)), stage([4, 5], (1, 4))], 1),
                            ([stage([6], (0, 3)), stage([7], (3, 4))], 1)),
}

BRIDGED_CLUSTER = {
    "islands": [{"name": "nv", "device": "A100-80GB", "nodes": 1, "gpus_per_node": 4},
                {"name": "amd", "device": "MI250X", "nodes": 1, "gpus_per_node": 4}],
    "links": [{"between": ["nv", "amd"], "bandwidth_gbps": 100}],
}
# (b) on the A100 + MI250X cluster: every cross-replica gradient group spans NCCL and RCCL islands
BRIDGED = plan(([stage([0, 1], (0, 3), "nv", "A100-80GB"), stage([2, 3], (3, 4), "nv", "A100-80GB")], 3),
               ([stage([4, 5, 6, 7], (0, 4), "amd", "MI250X")], 1))
# (e) every pipeline boundary and the layers-0..2 gradient groups cross from NVIDIA to AMD
CROSS_VENDOR_BOUNDARIES = plan(([stage([0, 1], (0, 2), "nv", "A100-80GB"), stage([2, 3], (2, 4), "amd", "MI250X")], 2),
                               ([stage([4, 5], (0, 3), "nv", "A100-80GB"), stage([6, 7], (3, 4), "amd", "MI250X")], 2))
# (d) a homogeneous plan: the runtime and plain megatron-core on TP2 x PP2 x DP2
HOMOGENEOUS = plan(([stage([0, 1], (0, 2)), stage([2, 3], (2, 4))], 2),
                   ([stage([4, 5], (0, 2)), stage([6, 7], (2, 4))], 2))
