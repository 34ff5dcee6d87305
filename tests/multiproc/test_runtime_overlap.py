"""Sequence parallelism, per-stage TP overlap and overlapped gradient reduction in the heterogeneous
runtime (issue #8, runtime integration).

One 6-process spawn runs, from the same initial weights as a single-process megatron-core run:
(a) a plan with sequence parallelism and mixed TP (replica A: TP2 -> TP1, replica B: TP1 -> TP2, so
sequence shards are re-split at every boundary and the tied embedding and the sequence-parallel
norms are held at TP 1 and 2); (b) the same with ``tp_comm_overlap`` on A's TP2 stage and B's TP1
stage (nothing to overlap there) but off on B's TP2 stage; (c) (b) with ``overlap_grad_reduce``,
megatron's default bucket size and small buckets. Losses: 1e-5 relative of the single-process run
(tests/test_runtime_parity.py's tolerance), parameters 1e-4; (b) vs (a) 1e-6 relative (parameters
1e-5 absolute); (c) bitwise with the default buckets, 1e-6 relative (parameters 1e-5) with small ones;
(d) (b) with a plan recording ``overlap_grad_reduce`` and no flag: overlapped (every bucket launched
in the backward), losses bitwise those of (b).
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_het.checkpoint.full_state import assemble_full_state
from megatron_het.cluster import ModelSpec
from megatron_het.model.groups import BlockShape
from megatron_het.plan import Plan, PlanError, ReplicaPlan, StagePlan, validate_plan
from megatron_het.platform.local_launch import run_local
from megatron_het.runtime.boundary import Transfer, sequence_transfers, shard_rows
from megatron_het.runtime.grad_sync import Holding, plan_buckets
from megatron_het.train.config import TrainConfig

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=200)
TRAIN = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=3, lr=1e-3)
PADDED_VOCAB = 256  # 200 padded to a multiple of 128 x lcm(TP sizes = 1, 2)
BUCKET = 20_000  # parameters per bucket in (c): several buckets per holder group


def _stage(ranks, layers, overlap=False):
    return StagePlan(island="cpu", device_type="CPU", ranks=tuple(ranks), layers=layers, tp_comm_overlap=overlap)


def sp_plan(overlap_a0=False, overlap_b0=False) -> Plan:
    return Plan(replicas=(
        ReplicaPlan(stages=(_stage([0, 1], (0, 2), overlap_a0), _stage([2], (2, 4))), num_micro_batches=2),
        ReplicaPlan(stages=(_stage([3], (0, 1), overlap_b0), _stage([4, 5], (1, 4))), num_micro_batches=2)),
        micro_batch_size=2, global_batch_size=8, sequence_parallel=True)


# ---- rank function (module-level for spawn) -------------------------------------------------

def cases_worker(rank, world_size, model, cases, init_full_state, padded_vocab):
    """Run (name, plan, train) cases one after another; per case the run, the overlap report and the
    overlapped synchronizer's counters."""
    import torch.distributed as dist

    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    from workers.megatron_workers import batch_fn

    enable_cpu_backend()
    out = {}
    for name, plan, train in cases:
        dist.barrier()
        trainer = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed),
                                init_full_state=init_full_state, padded_vocab=padded_vocab)
        res = trainer.run(return_shards=True)
        stage = trainer.strategy
        sync = getattr(stage.sync, "reducer", None) or stage.sync  # the distributed optimizer's overlapped buckets
        out[name] = {"run": res, "report": stage.overlap_report,
                     "launched": getattr(sync, "launched_in_backward", None),
                     "buckets": len(sync._groups), "stage": (stage.role.replica, stage.role.stage)}
    return out


@pytest.fixture(scope="module")
def runs():
    from workers.megatron_workers import megatron_block_worker

    ref = run_local(1, megatron_block_worker, (MODEL, TRAIN, BlockShape(tp=1, pp=1, dp=1), None, PADDED_VOCAB))[0]
    init = assemble_full_state([ref.initial_shards])
    overlap = sp_plan(overlap_a0=True, overlap_b0=True)
    cases = [("sp", sp_plan(), TRAIN), ("sp_tp_overlap", overlap, TRAIN),
             ("grad_overlap_one_bucket", overlap, dataclasses.replace(TRAIN, overlap_grad_reduce=True)),
             ("grad_overlap", overlap, dataclasses.replace(TRAIN, overlap_grad_reduce=True, ddp_bucket_size=BUCKET)),
             # the planner's record (#19): a plan with overlap_grad_reduce overlaps without the flag
             ("plan_records_overlap", dataclasses.replace(overlap, overlap_grad_reduce=True), TRAIN),
             # the distributed optimizer: reduce-scatter after the backward, or all-reduce buckets in it
             ("dist_opt", dataclasses.replace(overlap, use_distributed_optimizer=True), TRAIN),
             ("dist_opt_overlap", dataclasses.replace(overlap, use_distributed_optimizer=True),
              dataclasses.replace(TRAIN, overlap_grad_reduce=True, ddp_bucket_size=BUCKET)),
             ("dist_opt_plan_overlap", dataclasses.replace(overlap, use_distributed_optimizer=True,
                                                           overlap_grad_reduce=True), TRAIN)]
    per_rank = run_local(6, cases_worker, (MODEL, cases, init, PADDED_VOCAB), timeout_s=900)
    return ref, per_rank


def _losses(per_rank, name):
    return [log.lm_loss for log in per_rank[0][name]["run"].iterations]


def _final(per_rank, name):
    return assemble_full_state([out[name]["run"].shards for out in per_rank])


@pytest.mark.multiproc
@pytest.mark.slow
def test_sequence_parallel_mixed_tp_matches_single_process(runs):
    ref, per_rank = runs
    expected = [log.lm_loss for log in ref.iterations]
    losses = _losses(per_rank, "sp")
    assert len(losses) == TRAIN.train_iters
    for i, (a, b) in enumerate(zip(losses, expected)):
        assert abs(a - b) <= 1e-5 * abs(b), f"iteration {i + 1}: {a} vs single-process {b}"
    final, ref_final = _final(per_rank, "sp"), assemble_full_state([ref.shards])
    assert set(final) == set(ref_final), set(final) ^ set(ref_final)
    diffs = {k: float((final[k] - ref_final[k]).abs().max()) for k in ref_final}
    worst = max(diffs, key=diffs.get)
    print(f"sp: max |param diff| {diffs[worst]:.2e} at {worst}")
    assert diffs[worst] < 1e-4, f"{worst} differs by {diffs[worst]}"
    # the sequence-parallel norms really are partial per TP rank: without their TP sum the
    # final norm's weight (held at TP 1 by A and TP 2 by B) would be far off
    assert diffs["decoder.final_layernorm.weight"] < 1e-4


@pytest.mark.multiproc
@pytest.mark.slow
def test_tp_comm_overlap_on_one_stage_equals_plain_sequence_parallel(runs):
    _, per_rank = runs
    for a, b in zip(_losses(per_rank, "sp_tp_overlap"), _losses(per_rank, "sp")):
        assert abs(a - b) <= 1e-6 * abs(b), (a, b)
    # parameters: Adam turns a ~1e-7 relative gradient difference of a near-zero gradient element
    # into up to lr-sized steps, so parameters are held to an absolute bound (1% of lr)
    final, plain = _final(per_rank, "sp_tp_overlap"), _final(per_rank, "sp")
    worst = max(float((final[k] - plain[k]).abs().max()) for k in plain)
    print(f"tp_comm_overlap: max |param diff| vs plain sequence parallelism {worst:.2e}")
    assert worst <= 1e-5, worst
    reports = {out["sp_tp_overlap"]["stage"]: out["sp_tp_overlap"]["report"] for out in per_rank}
    a0 = reports[(0, 0)]  # TP2, two layers: qkv, proj, fc1, fc2 of each are swapped
    assert sorted(a0.overlapped) == sorted(f"decoder.layers.{i}.{m}" for i in (0, 1) for m in (
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"))
    assert "8 layers overlapped with chunks=4" in a0.describe()
    b0 = reports[(1, 0)]  # TP1: flag on, nothing to overlap; every layer listed with the reason
    assert b0.overlapped == () and len(b0.skipped) == 4
    assert all("no sequence parallelism" in why for _, why in b0.skipped)
    assert reports[(0, 1)] is None and reports[(1, 1)] is None  # flag off: untouched


@pytest.mark.multiproc
@pytest.mark.slow
def test_overlap_grad_reduce_equals_synchronous_reduction(runs):
    _, per_rank = runs
    sync_losses, sync_final = _losses(per_rank, "sp_tp_overlap"), _final(per_rank, "sp_tp_overlap")
    # megatron-core's default bucket size: the same buckets as the synchronous run, launched from
    # hooks: bitwise equal
    assert _losses(per_rank, "grad_overlap_one_bucket") == sync_losses
    one = _final(per_rank, "grad_overlap_one_bucket")
    assert all(bool((one[k] == sync_final[k]).all()) for k in sync_final)
    # small buckets: the same sums, split differently; gloo may add a 3-rank group's elements in
    # another order (1 fp32 ulp), so losses agree to a few ulps (1e-6 relative; 1e-7 is below one
    # fp32 ulp) and Adam's first steps amplify that for parameters. A bucket launched before its
    # gradients were final would be off by whole micro-batch contributions instead.
    for a, b in zip(_losses(per_rank, "grad_overlap"), sync_losses):
        assert abs(a - b) <= 1e-6 * abs(b), (a, b)
    final = _final(per_rank, "grad_overlap")
    worst = max(float((final[k] - sync_final[k]).abs().max()) for k in sync_final)
    print(f"overlap_grad_reduce, {BUCKET}-parameter buckets: max |param diff| vs synchronous {worst:.2e}")
    assert worst <= 1e-5, worst
    assert _losses(per_rank, "plan_records_overlap") == sync_losses
    for out in per_rank:  # every bucket launched during the last backward; small ones are more
        for name in ("grad_overlap_one_bucket", "grad_overlap", "plan_records_overlap"):
            assert out[name]["launched"] == out[name]["buckets"] > 0, (name, out[name])
        assert out["grad_overlap"]["buckets"] > out["sp_tp_overlap"]["buckets"]
        assert out["sp_tp_overlap"]["launched"] is None  # the plain synchronizer without the flag


@pytest.mark.multiproc
@pytest.mark.slow
def test_distributed_optimizer_with_overlapped_buckets_equals_its_reduce_scatter(runs):
    """--use-distributed-optimizer --overlap-grad-reduce: the gradients are all-reduced in buckets
    launched during the last backward and each owner takes its pieces of the sums; the reduce-scatter
    after the backward gives the same sums, added in another order (1e-6 relative on losses, 1e-5 on
    parameters, as above). A plan recording the overlap also gathers the updated weights during the
    next forward (--overlap-param-gather). A bucket launched before its gradients were final, or a
    piece taken from the wrong owner's offsets, would be off by whole contributions."""
    _, per_rank = runs
    ref_losses, ref_final = _losses(per_rank, "dist_opt"), _final(per_rank, "dist_opt")
    for name in ("dist_opt_overlap", "dist_opt_plan_overlap"):
        for a, b in zip(_losses(per_rank, name), ref_losses):
            assert abs(a - b) <= 1e-6 * abs(b), (name, a, b)
        final = _final(per_rank, name)
        worst = max(float((final[k] - ref_final[k]).abs().max()) for k in ref_final)
        print(f"{name}: max |param diff| vs the reduce-scatter after the backward {worst:.2e}")
        assert worst <= 1e-5, (name, worst)
    for out in per_rank:
        assert out["dist_opt"]["launched"] is None  # no reducer without the flag or the record
        for name in ("dist_opt_overlap", "dist_opt_plan_overlap"):
            assert out[name]["launched"] == out[name]["buckets"] > 0, (name, out[name])


# ---- pure pieces -----------------------------------------------------------------------------

@pytest.mark.parametrize("a,b", [(1, 2), (2, 1), (2, 4), (4, 2), (2, 3), (3, 2), (4, 4)])
def test_sequence_transfers_cover_each_receiver_row_once(a, b):
    seq = 12
    transfers = sequence_transfers(seq, a, b)
    for j in range(b):
        rows = sorted(t.rows for t in transfers if t.receiver == j)
        covered = [r for lo, hi in rows for r in range(lo, hi)]
        assert covered == list(range(*shard_rows(seq, b, j)))
    for t in transfers:  # every piece lies inside its sender's shard
        lo, hi = shard_rows(seq, a, t.sender)
        assert lo <= t.rows[0] < t.rows[1] <= hi
    assert sum(t.rows[1] - t.rows[0] for t in transfers) == seq  # each row crosses once


def test_sequence_transfers_concrete():
    assert sequence_transfers(12, 2, 3) == [Transfer(sender=0, receiver=0, rows=(0, 4)),
                                            Transfer(sender=0, receiver=1, rows=(4, 6)),
                                            Transfer(sender=1, receiver=1, rows=(6, 8)),
                                            Transfer(sender=1, receiver=2, rows=(8, 12))]
    with pytest.raises(ValueError, match="TP size 5 to divide seq_length 12"):
        shard_rows(12, 5, 0)


def _h(name, rank, stage, tp_rank, tp, dim=None, shape=(4,), sp=False):
    return Holding(name=name, rank=rank, stage_key=stage, tp_rank=tp_rank, tp_size=tp, partition_dim=dim,
                   full_shape=shape, sequence_parallel=sp)


def test_sequence_parallel_params_reduce_over_tp_peers_too():
    # one replica at TP 2: a sequence-parallel norm still needs its TP sum; a plain one does not
    hs = [_h("ln", 0, (0, 0), 0, 2, sp=True), _h("ln", 1, (0, 0), 1, 2, sp=True),
          _h("b", 0, (0, 0), 0, 2), _h("b", 1, (0, 0), 1, 2)]
    assert [(b.ranks, b.names, b.direct) for b in plan_buckets(hs)] == [((0, 1), ("ln",), False)]
    # with a TP1 replica beside it (unmarked there): one group over all three holders
    hs += [_h("ln", 2, (1, 0), 0, 1), _h("b", 2, (1, 0), 0, 1)]
    got = [(b.ranks, b.names, b.direct) for b in plan_buckets(hs)]
    assert got == [((0, 1, 2), ("b", "ln"), False)]
    with pytest.raises(ValueError, match="must be replicated across TP ranks"):
        plan_buckets([_h("w", 0, (0, 0), 0, 2, dim=0, sp=True), _h("w", 1, (0, 0), 1, 2, dim=0, sp=True)])


def test_bucket_numel_splits_groups_in_backward_order():
    names = ["emb", "l0", "l1", "l2"]  # forward order on every rank
    hs = [_h(n, r, (r, 0), 0, 1, shape=(10,)) for r in (0, 1) for n in names]
    assert [b.names for b in plan_buckets(hs)] == [("l2", "l1", "l0", "emb")]
    assert [b.names for b in plan_buckets(hs, bucket_numel=20)] == [("l2", "l1"), ("l0", "emb")]
    assert [b.names for b in plan_buckets(hs, bucket_numel=25)] == [("l2", "l1", "l0"), ("emb",)]


@pytest.mark.parametrize("name,stages,micro", [("1f1b", 3, 4), ("gpipe", 2, 3), ("zb-h1", 3, 5)])
def test_gradient_buckets_are_armed_before_the_last_backward(name, stages, micro):
    from megatron_het.runtime.executor import grad_reduce_trigger
    from megatron_het.schedule import build_schedule

    for acts in build_schedule(name, stages, micro, 1).actions:
        i = grad_reduce_trigger(acts)
        assert str(acts[i]) == f"B{micro - 1}"  # the last micro-batch's backward ...
        assert all(a.kind != "B" for a in acts[i + 1:])  # ... and only W no-ops (zb-h1) or nothing after
    assert grad_reduce_trigger(()) is None


# ---- errors ----------------------------------------------------------------------------------

def test_tp_comm_overlap_needs_sequence_parallel():
    plan = dataclasses.replace(sp_plan(overlap_a0=True), sequence_parallel=False)
    with pytest.raises(PlanError) as err:
        validate_plan(plan, MODEL)
    msg = str(err.value)
    assert msg.startswith("replicas[0].stages[0].tp_comm_overlap:") and '"sequence_parallel": true' in msg
    from megatron_het.runtime.hetero_trainer import HeteroTrainer  # refused before any process group

    with pytest.raises(PlanError, match=r"replicas\[0\]\.stages\[0\]\.tp_comm_overlap"):
        HeteroTrainer(model=MODEL, plan=plan, train=TRAIN, batch_fn=None)
    validate_plan(sp_plan(overlap_a0=True), MODEL)  # with sequence parallelism: valid


def test_sequence_parallel_needs_tp_dividing_seq_length():
    model = dataclasses.replace(MODEL, seq_length=30)
    plan = Plan(replicas=(ReplicaPlan(stages=(_stage([0, 1, 2, 3], (0, 4)),), num_micro_batches=4),),
                micro_batch_size=2, global_batch_size=8, sequence_parallel=True)
    with pytest.raises(PlanError, match="sequence_parallel needs TP size 4 to divide seq_length=30"):
        validate_plan(plan, model)


@pytest.mark.parametrize("field,value,text", [
    ("tp_comm_overlap_chunks", 0, "tp_comm_overlap_chunks must be >= 1, got 0 (limit 1)"),
    ("ddp_bucket_size", 0, "ddp_bucket_size must be >= 1 parameter or None, got 0 (limit 1)"),
])
def test_train_config_overlap_fields_are_validated(field, value, text):
    with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
        dataclasses.replace(TRAIN, **{field: value})


# ---- performance model -----------------------------------------------------------------------

def test_predict_models_the_runtime_bucketing_every_stage():
    from megatron_het.cluster import CATALOG, ClusterSpec, IslandSpec
    from megatron_het.perf.predict import predict
    from megatron_het.plan import homogeneous_plan

    # untied output layer: a tied embedding's own group (first + last stages, after stage 0's last backward)
    # would end the last stage's reduction in both forms and hide the per-stage bucketing compared here
    model = ModelSpec(num_layers=8, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=32000,
                      untie_embeddings_and_output_weights=True)
    island = IslandSpec(name="a", device=CATALOG["A100-80GB"], nodes=2, gpus_per_node=8,
                        inter_node_bandwidth_gbps=25.0)
    cluster = ClusterSpec(islands=(island,))
    plan = homogeneous_plan(tp=1, pp=4, dp=4, num_layers=8, micro_batch_size=1, global_batch_size=32,
                            island="a", device_type="A100-80GB")
    megatron = predict(plan, model, cluster, overlap_grad_reduce=True).replicas[0].stages
    runtime = predict(plan, model, cluster, overlap_grad_reduce=True, bucket_all_stages=True).replicas[0].stages
    plain = predict(plan, model, cluster, bucket_all_stages=True).replicas[0].stages  # no effect without overlap
    assert runtime[0].gradient_reduction_end_s == megatron[0].gradient_reduction_end_s  # stage 0: same model
    for i in (1, 2, 3):  # megatron reduces later stages at their end; the runtime in buckets during backward
        assert megatron[i].gradient_reduction_end_s == plain[i].gradient_reduction_end_s
        assert runtime[i].gradient_reduction_end_s < megatron[i].gradient_reduction_end_s
