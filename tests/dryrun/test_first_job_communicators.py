"""Communicators of the first GPU job's plans, rank by rank on torch's fake backend (issue #36).

The plans tools/plan.py chooses for Llama-2-7B (docs/gpu.md section 5): on 8 x H100 eight TP1
replicas with the distributed optimizer; on 8 x MI250X four replicas of a two-stage pipeline with
the distributed optimizer and overlapped gradient reduction. Each simulated rank builds what the
trainer builds before data flows: its stage groups (runtime/stage_groups.py), the pipeline
boundaries' groups (runtime/boundary_groups.py: one per boundary, its transfers batched) and,
through one ``ReductionGroups``, the overlapped reducer's bucket groups (megatron-core's default
bucket size) and the distributed optimizer's. Counted: the groups this rank is a member of. The
issue's bound is "pipeline boundaries + distinct holder sets + TP groups": boundaries + holder sets
+ 1 (the stage's TP group, which at TP1 is the rank's own group of one that every collection role
shares). Before #36 the H100 plan's count was 9 grid groups + one group per bucket, and a boundary
had a group per direction.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_het.cluster import load_model
from megatron_het.optim.distributed import DistributedOptimizer
from megatron_het.perf.predict import bucket_parameters
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.runtime.boundary_groups import create_boundary_groups, plan_boundary_keys
from megatron_het.runtime.comm_routing import ReductionGroups
from megatron_het.runtime.grad_sync import owned_norm_holdings, plan_buckets
from megatron_het.runtime.holdings import plan_holdings
from megatron_het.runtime.overlap_grad import OverlappedGradientSynchronizer
from megatron_het.runtime.stage_groups import build_stage_groups
from megatron_het.train.config import TrainConfig

from support.fake_grad_sync import FAKE_ACCELERATOR, META_ACCELERATOR, answer_gather_with, by_rank
from support.fake_world import TIMEOUT, creation_order_mismatch, simulate_ranks

ROOT = Path(__file__).parents[2]
MODEL = load_model(ROOT / "examples/models/llama2-7b.yaml")


def _stage(island, device, ranks, layers):
    return StagePlan(island=island, device_type=device, ranks=tuple(ranks), layers=layers)


H100 = Plan(replicas=tuple(ReplicaPlan(stages=(_stage("h100", "H100-SXM", [r], (0, 32)),), num_micro_batches=8)
                           for r in range(8)),
            micro_batch_size=1, global_batch_size=64, use_distributed_optimizer=True, precision="bf16")
MI250X = Plan(replicas=tuple(ReplicaPlan(stages=(_stage("mi250x", "MI250X", [2 * r], (0, 16)),
                                                 _stage("mi250x", "MI250X", [2 * r + 1], (16, 32))),
                                         num_micro_batches=16) for r in range(4)),
              micro_batch_size=1, global_batch_size=64, use_distributed_optimizer=True, overlap_grad_reduce=True,
              schedule="zb-h1", precision="bf16")


def _view(gathered):
    def build(plan: Plan) -> dict:
        rank = dist.get_rank()
        build_stage_groups(plan, timeout=TIMEOUT)
        create_boundary_groups(plan_boundary_keys(plan), spans_libraries=lambda ranks: False, backend=None,
                               timeout=TIMEOUT)
        local = gathered[rank]
        params = {h.name: torch.nn.Parameter(torch.empty(h.full_shape, device="meta")) for h in local}
        groups = ReductionGroups(None, accelerator=FAKE_ACCELERATOR, timeout=TIMEOUT)
        bucket = bucket_parameters(len(plan.replicas))  # the trainer's default --ddp-bucket-size
        reducer = (OverlappedGradientSynchronizer(local, params, bucket_numel=bucket, accelerator=META_ACCELERATOR,
                                                  groups=groups)
                   if plan.overlap_grad_reduce else None)
        train = TrainConfig(micro_batch_size=1, global_batch_size=plan.global_batch_size, train_iters=1)
        DistributedOptimizer(local, params, train=train, device=torch.device("meta"), owned=owned_norm_holdings,
                             new_group=groups, reducer=reducer, bucket_numel=bucket)
        return {"holder_sets": len({b.ranks for b in plan_buckets([h for hs in gathered for h in hs])
                                    if rank in b.ranks and len(b.ranks) > 1}),
                "boundaries": sum(1 for ranks in plan_boundary_keys(plan) if rank in ranks)}

    return build


@pytest.mark.parametrize("plan", [H100, dataclasses.replace(H100, overlap_grad_reduce=True), MI250X],
                         ids=["7b_8xh100", "7b_8xh100_overlap_grad_reduce", "7b_8xmi250x"])
def test_first_job_communicators_per_rank(plan, monkeypatch):
    gathered = by_rank(plan_holdings(plan, MODEL), plan.world_size)
    answer_gather_with(monkeypatch, gathered)
    sims = simulate_ranks(plan, range(plan.world_size), _view(gathered), monkeypatch)
    assert creation_order_mismatch(sims) is None
    for rank, sim in sims.items():
        mine = [ranks for ranks, *_ in sim.creations if rank in ranks]  # one creation, one group
        bound = sim.result["boundaries"] + sim.result["holder_sets"] + 1
        print(f"rank {rank}: {len(mine)} communicators besides the world ({sim.result}); bound {bound}")
        assert len(mine) <= bound, (rank, sorted(mine), sim.result)
