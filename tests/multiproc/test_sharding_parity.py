"""Uneven sharded data parallelism trains exactly like one process (issue 9, Cephalo).

Reference: megatron-core on one process (``megatron_block_worker``), micro-batch size 1 x 8
micro-batches. Megatron averages per-micro-batch *means*; with equal micro-batches of one sample
each that is the mean over samples, i.e. the mean token loss of the global batch (all samples
have seq_length tokens). The sharded runtime divides each micro-batch's *sum* of token losses by
``global_batch_size x seq_length``, so every sample weighs the same whatever its rank's
micro-batch size (1, 1, 2, 4 below) — the same objective, so the same gradients. A reference
with uneven micro-batches would weight samples unequally and is not what we compare against.

One 4-process spawn runs every case (each spawn pays megatron's import): the uneven
collectives on known values, three plans (uneven shards, uneven batches with recompute on one
rank, uneven micro-batch counts with the other collective methods), a checkpoint written under
one shard layout and resumed under another, and emulated memory budgets. Losses must match within
1e-5 relative (fp32) every iteration and final parameters within 1e-4 absolute.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from megatron_het.checkpoint.full_state import assemble_full_state
from megatron_het.cluster import ModelSpec
from megatron_het.model.groups import BlockShape
from megatron_het.perf.sharded import sharded_rank_memory
from megatron_het.platform.local_launch import run_local
from megatron_het.sharding import RankShare, ShardedPlan
from megatron_het.train.config import TrainConfig

from workers.megatron_workers import megatron_block_worker
from workers.sharding_workers import sharded_cases_worker

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=200)
TRAIN = TrainConfig(micro_batch_size=1, global_batch_size=8, train_iters=5, lr=1e-3)
PADDED_VOCAB = 256
NUMEL = 218_496  # parameters of MODEL with the 256-row padded vocabulary (tied embeddings)
SIZES = (1, 2, 3, 1)


def plan(mbs, nmb, fractions, recompute=(False,) * 4) -> ShardedPlan:
    return ShardedPlan(ranks=tuple(RankShare(rank=i, island="cpu", device_type="CPU", micro_batch_size=mbs[i],
                                             num_micro_batches=nmb[i], shard_fraction=fractions[i],
                                             recompute=recompute[i]) for i in range(4)),
                       global_batch_size=TRAIN.global_batch_size)


UNEVEN = (0.1, 0.2, 0.3, 0.4)
PLANS = {
    "uneven_shards": plan((2, 2, 2, 2), (1, 1, 1, 1), UNEVEN),
    "uneven_batches": plan((1, 1, 2, 4), (1, 1, 1, 1), UNEVEN, (False, False, False, True)),
    "uneven_micro_counts": plan((1, 1, 1, 2), (2, 1, 1, 2), (0.4, 0.0, 0.35, 0.25)),
}
# uneven shards over an emulated A100 + MI250X pair of islands: the state's all-gather and
# reduce-scatter span NCCL and RCCL ranks, so they go through the het bridge
BRIDGED_CLUSTER = {
    "islands": [{"name": "nv", "device": "A100-80GB", "nodes": 1, "gpus_per_node": 2},
                {"name": "amd", "device": "MI250X", "nodes": 1, "gpus_per_node": 2}],
    "links": [{"between": ["nv", "amd"], "bandwidth_gbps": 100}],
}
BRIDGED = ShardedPlan(ranks=tuple(RankShare(rank=i, island=("nv", "nv", "amd", "amd")[i],
                                            device_type=("A100-80GB", "A100-80GB", "MI250X", "MI250X")[i],
                                            micro_batch_size=2, num_micro_batches=1, shard_fraction=UNEVEN[i])
                                  for i in range(4)), global_batch_size=TRAIN.global_batch_size)
RESUME_FROM, RESUME_INTO = PLANS["uneven_batches"], plan((2, 2, 2, 2), (1, 1, 1, 1), (0.4, 0.3, 0.2, 0.1))
EQUAL_STATE = plan((1, 1, 2, 4), (1, 1, 1, 1), (0.25,) * 4, (False, False, False, True))


def budgets() -> list[int]:
    """Each rank's room for exactly its UNEVEN shard (+1%): an equal 25% shard overflows ranks 0, 1."""
    out = []
    for r in RESUME_FROM.ranks:
        m = sharded_rank_memory(MODEL, shard_fraction=r.shard_fraction * 1.01, micro_batch_size=r.micro_batch_size,
                                recompute=r.recompute, precision="fp32", overhead_bytes=0, num_parameters=NUMEL)
        out.append(m.total_bytes)
    return out


@pytest.fixture(scope="module")
def runs():
    ref = run_local(1, megatron_block_worker, (MODEL, TRAIN, BlockShape(tp=1, pp=1, dp=1), None, PADDED_VOCAB))[0]
    init = assemble_full_state([ref.initial_shards])
    assert sum(t.numel() for t in init.values()) == NUMEL
    cases = [{"name": "collectives", "kind": "collectives", "sizes": SIZES}]
    cases += [{"name": n, "kind": "train", "plan": p} for n, p in PLANS.items()]
    cases[-1].update(gather="broadcast", reduce_scatter="all_reduce")
    cases += [{"name": "bridged_nv_amd", "kind": "train", "plan": BRIDGED, "cluster": BRIDGED_CLUSTER}]
    cases += [{"name": "resume", "kind": "resume", "plan": RESUME_FROM, "resume_plan": RESUME_INTO, "split": 3},
              {"name": "budget_uneven", "kind": "budget", "plan": RESUME_FROM, "budgets": budgets()},
              {"name": "budget_equal", "kind": "budget", "plan": EQUAL_STATE, "budgets": budgets()}]
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = run_local(4, sharded_cases_worker, (MODEL, cases, TRAIN, init, PADDED_VOCAB, tmp))
    return ref, per_rank


def _check_losses(name, losses, ref_losses):
    assert len(losses) == len(ref_losses)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{name} iteration {i + 1}: {a} vs single-process {b}"


def _check_params(name, shards, ref):
    final, ref_final = assemble_full_state([shards]), assemble_full_state([ref.shards])
    assert set(final) == set(ref_final), set(final) ^ set(ref_final)
    diffs = {k: float((final[k] - ref_final[k]).abs().max()) for k in ref_final}
    worst = max(diffs, key=diffs.get)
    print(f"{name}: max |param diff| {diffs[worst]:.2e} at {worst}")
    assert diffs[worst] < 1e-4, f"{name}: {worst} differs by {diffs[worst]}"
    moved = max(float((final[k] - assemble_full_state([ref.initial_shards])[k]).abs().max()) for k in final)
    assert moved > 1e-3  # training did change the weights: the comparison is not vacuous


@pytest.mark.multiproc
def test_uneven_collectives(runs):
    _, per_rank = runs
    starts = [sum(SIZES[:r]) for r in range(4)]
    gathered = torch.cat([torch.arange(s, s + n, dtype=torch.float32) * (r + 1)
                          for r, (s, n) in enumerate(zip(starts, SIZES))])
    for rank, out in enumerate(per_rank):
        res = out["collectives"]
        for method in ("padded", "broadcast"):
            assert res[f"gather_{method}"].tolist() == gathered.tolist(), (rank, method)
        # reduce-scatter: the given uneven layout, equal shards (the tensor form), an empty shard on rank 0
        for tag, sizes in (("", SIZES), ("equal_", (2, 2, 2, 2)), ("empty_", (0,) + SIZES[1:])):
            lo = sum(sizes[:rank])
            summed = sum(torch.arange(sum(sizes), dtype=torch.float32) + 100 * r for r in range(4))
            for method in ("native", "reduce", "all_reduce"):
                got = res[f"{tag}rs_{method}"]
                assert got.tolist() == summed[lo:lo + sizes[rank]].tolist(), (rank, tag, method)
                assert res[f"{tag}rs_{method}_unchanged"], (rank, tag, method)
        summed = sum(torch.arange(sum(SIZES), dtype=torch.float32) + 100 * r for r in range(4))
        assert res["gloo_rs_native"].tolist() == summed[starts[rank]:starts[rank] + SIZES[rank]].tolist()


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [*PLANS, "bridged_nv_amd"])
def test_sharded_plan_matches_single_process(runs, name):
    ref, per_rank = runs
    res = per_rank[0][name]
    _check_losses(name, [log.lm_loss for log in res.iterations], [log.lm_loss for log in ref.iterations])
    for log, ref_log in zip(res.iterations, ref.iterations):
        assert log.grad_norm == pytest.approx(ref_log.grad_norm, rel=1e-4)
    _check_params(name, res.shards, ref)


@pytest.mark.multiproc
def test_checkpoint_resumes_into_another_shard_layout(runs):
    """3 iterations under shards 10/20/30/40% and batches 1/1/2/4, saved; loaded under 40/30/20/10%
    and batches 2/2/2/2 for the last 2: the 5 losses and final weights equal the reference's."""
    ref, per_rank = runs
    first, second, loaded = per_rank[0]["resume"]
    assert loaded == 3
    losses = [log.lm_loss for log in first.iterations + second.iterations]
    _check_losses("resume", losses, [log.lm_loss for log in ref.iterations])
    _check_params("resume", second.shards, ref)


@pytest.mark.multiproc
def test_memory_budget_admits_the_uneven_plan_and_refuses_equal_shards(runs):
    _, per_rank = runs
    assert [out["budget_uneven"] for out in per_rank] == ["ok"] * 4
    equal = [out["budget_equal"] for out in per_rank]
    assert equal[2:] == ["ok", "ok"]  # 25% is below their 30% / 40% room
    for rank in (0, 1):
        assert equal[rank].startswith(f"memory_budget_bytes[{rank}]: rank {rank} needs ")
        assert f"budget is {budgets()[rank]} bytes" in equal[rank] and "shard_fraction 0.2500" in equal[rank]
        assert "Fix: lower this rank's shard_fraction" in equal[rank]


@pytest.mark.multiproc
def test_cross_vendor_sharded_collectives_go_through_the_bridge(runs):
    _, per_rank = runs
    sent = [out[("bridge_bytes", "bridged_nv_amd")] for out in per_rank]
    assert all(b is not None for b in sent) and sum(b > 0 for b in sent) >= 2, sent  # each island's leader sent
    assert all(out[("bridge_bytes", "uneven_shards")] is None for out in per_rank)  # one library: native
