"""Placement (issue 14): every tensor the runtime creates is on the accelerator's device, every group
has a backend the accelerator chose.

One step of a mixed-TP two-replica pipeline plan, of the same plan on an emulated A100 + MI250X
cluster (bridged gradient groups), and of a two-replica uneven sharded plan, each built and run
inside ``support.placement.PlacementTrap`` with an accelerator whose device object is ``cpu:0``
(not the default ``cpu``): a factory call without ``device=``, or with a literal device, and a
``new_group`` without the accelerator's backend are reported with file and line.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_het.cluster import ModelSpec
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import run_local
from megatron_het.sharding import RankShare, ShardedPlan
from megatron_het.train.config import TrainConfig

from support.placement import PACKAGE, PlacementTrap
from workers.placement_workers import placement_accelerator, placement_worker

MODEL = ModelSpec(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100)
TRAIN = TrainConfig(micro_batch_size=1, global_batch_size=4, train_iters=1, lr=1e-3)


def _stage(ranks, layers, island="fast", device="CPU"):
    return StagePlan(island=island, device_type=device, ranks=tuple(ranks), layers=layers)


# replica 0: TP2 -> TP1 over two stages (3 micro-batches); replica 1: one TP1 stage (1 micro-batch)
MIXED_TP = Plan(replicas=(ReplicaPlan(stages=(_stage([0, 1], (0, 2)), _stage([2], (2, 4))), num_micro_batches=3),
                          ReplicaPlan(stages=(_stage([3], (0, 4), "slow"),), num_micro_batches=1)),
                micro_batch_size=1, global_batch_size=4)
BRIDGED_CLUSTER = {
    "islands": [{"name": "nv", "device": "A100-80GB", "nodes": 1, "gpus_per_node": 3},
                {"name": "amd", "device": "MI250X", "nodes": 1, "gpus_per_node": 1}],
    "links": [{"between": ["nv", "amd"], "bandwidth_gbps": 100}],
}
BRIDGED = Plan(replicas=(ReplicaPlan(stages=(_stage([0, 1], (0, 2), "nv", "A100-80GB"),
                                             _stage([2], (2, 4), "nv", "A100-80GB")), num_micro_batches=3),
                         ReplicaPlan(stages=(_stage([3], (0, 4), "amd", "MI250X"),), num_micro_batches=1)),
               micro_batch_size=1, global_batch_size=4)
SHARDED = ShardedPlan(ranks=tuple(RankShare(rank=i, island="cpu", device_type="CPU", micro_batch_size=1,
                                            num_micro_batches=n, shard_fraction=f, recompute=False)
                                  for i, (n, f) in enumerate([(2, 0.4), (1, 0.3), (1, 0.2), (0, 0.1)])),
                      global_batch_size=4)


@pytest.fixture(scope="module")
def runs():
    cases = [("pipeline_mixed_tp", MIXED_TP, None), ("pipeline_bridged", BRIDGED, BRIDGED_CLUSTER),
             ("sharded", SHARDED, None)]
    return run_local(4, placement_worker, (MODEL, TRAIN, cases))


@pytest.mark.parametrize("case", ["pipeline_mixed_tp", "pipeline_bridged", "sharded"])
def test_every_tensor_and_group_is_the_accelerators(runs, case):
    for rank, out in enumerate(runs):
        violations, factory_calls, groups, loss = out[case]
        assert not violations, f"rank {rank}, {case}:\n" + "\n".join(violations)
        assert factory_calls > 0, f"rank {rank}: the trap saw no runtime factory call (is it wired?)"
        assert groups, f"rank {rank}: the trap saw no new_group"
        assert math.isfinite(loss)


def _run_in(package_file: str, src: str):
    """Run ``src`` as if it were code of ``megatron_het/<package_file>`` (the trap scopes by file)."""
    exec(compile(src, str(PACKAGE / package_file), "exec"), {"torch": torch, "acc": placement_accelerator()})


def test_the_trap_catches_a_literal_or_missing_device():
    """The trap can fail: a buffer created with a literal device, or none, in runtime code."""
    acc = placement_accelerator()
    with PlacementTrap(acc) as trap:
        _run_in("runtime/boundary.py", "torch.empty(4, device=acc.device)")
    assert trap.violations == [] and trap.factory_calls == 1
    for src in ('torch.empty(4, device="cpu")', "torch.zeros(4)", "torch.tensor([1.0])"):
        with PlacementTrap(acc) as trap:
            _run_in("runtime/boundary.py", src)
        assert len(trap.violations) == 1 and "runtime/boundary.py:1" in trap.violations[0], (src, trap.violations)
    with PlacementTrap(acc) as trap:  # code outside the runtime (tests, megatron-core) is not judged
        _run_in("../tests/x.py", "torch.zeros(4)")
    assert trap.violations == [] and Path(PACKAGE).is_dir()
