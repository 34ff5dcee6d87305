"""The distributed optimizer makes no full-size temporary in any phase of a run (issue #36 item 1).

Two ranks, one replica each (the data-parallel-only plan of a first GPU job), bf16, with
--use-distributed-optimizer and a gradient bucket smaller than the model, train two iterations, save
and load, every allocation recorded (``platform/allocation_peak``: torch's allocator records, not
the tensors held afterwards). Per parameter the rank holds bf16 values (2 bytes), fp32 main
gradients (4) and half of the fp32 main values and two moments (12 / 2): 12 bytes. Each phase
must stay under one full-size copy of what it works on: construction never holds a full fp32 copy
of the parameters (it did: 14 bytes/parameter), the reduce-scatter adds less than one fp32 gradient
copy (4; it added 10), the step less than one bf16 parameter copy (2; it added 6), a save less
than one rank's full fp32 state (12; it added 18). A load reads the stage's slots a group at a time
(``dist_ckpt.load_in_groups``): with reads of 1 MB it adds at most twice one group's buffers (or the
largest parameter's) where one read of everything adds 12 bytes/parameter, and restores the same
state bit for bit.

The same ranks without the distributed optimizer (bf16 main parameters, Megatron's default bucket:
the whole model in one) reduce each bucket in place in the buffer their gradients live in: the
reduction adds no packed copy (it added 4 bytes/parameter), and with --overlap-grad-reduce the
backward holds none until the reduction waits (it held 4 more).
"""

from __future__ import annotations

import pytest

from megatron_het.cluster import ModelSpec
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import run_local
from megatron_het.train.config import TrainConfig

from workers.dist_opt_workers import phase_bytes_worker

# embedding 1024 x 256 = 262k of 3.4M elements: the largest parameter, so the largest bucket
MODEL = ModelSpec(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=64, vocab_size=1024,
                  max_position_embeddings=64)
BUCKET = 200_000  # --ddp-bucket-size: about 15 buckets


def _plan(distributed_optimizer: bool = True) -> Plan:
    def stage(r):
        return StagePlan(island="cpu", device_type="CPU", ranks=(r,), layers=(0, 4))

    return Plan(replicas=tuple(ReplicaPlan(stages=(stage(r),), num_micro_batches=2) for r in (0, 1)),
                micro_batch_size=2, global_batch_size=8, precision="bf16",
                use_distributed_optimizer=distributed_optimizer)


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    train = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=2, lr=1e-3, bf16=True,
                        ddp_bucket_size=BUCKET)
    save = str(tmp_path_factory.mktemp("ckpt"))
    return run_local(2, phase_bytes_worker, (MODEL, _plan(), train, save, 1024))


@pytest.mark.multiproc
@pytest.mark.parametrize("phase, limit", [("reduce", 4.0), ("optimizer_step", 2.0), ("save", 12.0)])
def test_no_phase_adds_a_full_size_copy(phases, phase, limit):
    for rank, (bytes_of, params, *_) in enumerate(phases):
        start, _, added = bytes_of[phase]
        added /= params
        print(f"rank {rank} {phase}: +{added:.2f} bytes/parameter over {start / params:.2f}")
        assert added < limit, f"rank {rank} {phase}: +{added:.2f} bytes/parameter (limit {limit})"


@pytest.mark.multiproc
def test_construction_holds_no_full_fp32_copy(phases):
    for rank, (bytes_of, params, *_) in enumerate(phases):
        _, peak, _ = bytes_of["construction"]
        print(f"rank {rank} construction peak: {peak / params:.2f} bytes/parameter")
        assert peak / params <= 12.0 * 1.01, f"rank {rank}: {peak / params:.2f} bytes/parameter > 12"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Without the distributed optimizer, one bucket: {overlap: per-rank phases}."""
    out = {}
    for overlap in (False, True):
        train = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=2, lr=1e-3, bf16=True,
                            overlap_grad_reduce=overlap)
        save = str(tmp_path_factory.mktemp("ckpt"))
        out[overlap] = run_local(2, phase_bytes_worker, (MODEL, _plan(False), train, save, 1024))
    return out


@pytest.mark.multiproc
def test_gradients_are_reduced_in_their_buffer(plain):
    for rank in range(2):
        (off, params, *_), (on, *_) = plain[False][rank], plain[True][rank]
        reduce = off["reduce"][2] / params
        held_longer = (on["forward_backward"][2] - off["forward_backward"][2]) / params
        print(f"rank {rank}: reduce +{reduce:.2f} bytes/parameter; overlapped backward {held_longer:+.2f}")
        assert reduce < 1.0, f"rank {rank}: the reduction added {reduce:.2f} bytes/parameter"
        assert held_longer < 1.0, f"rank {rank}: the overlapped backward held {held_longer:.2f} bytes/parameter more"


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    train = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=2, lr=1e-3, bf16=True,
                        ddp_bucket_size=BUCKET)
    save = str(tmp_path_factory.mktemp("ckpt"))
    return run_local(2, phase_bytes_worker, (MODEL, _plan(), train, save, 1024, 2**20))


# one read's host buffers at most: fp32 value and two moments of a group, or of the largest parameter
# (the 262k-element embedding) alone; torch.distributed.checkpoint stages what it reads once more
READ_BUFFERS = 2 * max(2**20, 12 * 262_144)


@pytest.mark.multiproc
def test_a_streamed_load_holds_one_group_and_restores_the_state(phases, streamed):
    for rank, ((whole, params, before, after), (parts, _, s_before, s_after)) in enumerate(zip(phases, streamed)):
        one_read, grouped = whole["load"][2], parts["load"][2]
        print(f"rank {rank} load: one read +{one_read / params:.2f} bytes/parameter, 1 MB reads "
              f"+{grouped / params:.2f} ({grouped / 2**20:.1f} MiB; bound {READ_BUFFERS / 2**20:.1f})")
        assert one_read / params > 8.0 and grouped <= READ_BUFFERS, (one_read, grouped)
        assert after == before and s_after == s_before == before  # the same run, saved and read back exactly


@pytest.fixture(scope="module")
def streamed_pipeline(tmp_path_factory):
    """Two stages of unequal size: their ranks have different numbers of groups to read."""
    def stage(r, layers):
        return StagePlan(island="cpu", device_type="CPU", ranks=(r,), layers=layers)

    plan = Plan(replicas=(ReplicaPlan(stages=(stage(0, (0, 1)), stage(1, (1, 4))), num_micro_batches=4),),
                micro_batch_size=2, global_batch_size=8, precision="bf16", use_distributed_optimizer=True)
    train = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=2, lr=1e-3, bf16=True)
    save = str(tmp_path_factory.mktemp("ckpt"))
    return run_local(2, phase_bytes_worker, (MODEL, plan, train, save, 1024, 2**20))


@pytest.mark.multiproc
def test_ranks_with_different_numbers_of_reads_load_together(streamed_pipeline):
    params = [out[1] for out in streamed_pipeline]
    assert params[1] > 2 * params[0]  # rank 1 reads more groups; rank 0 joins its last reads with none
    for rank, (bytes_of, n, before, after) in enumerate(streamed_pipeline):
        assert after == before, rank
        assert bytes_of["load"][2] <= READ_BUFFERS, (rank, bytes_of["load"][2])
