"""The distributed optimizer makes no full-size temporary in any phase of a run (issue #36 item 1).

Two ranks, one replica each (the data-parallel-only plan of a first GPU job), bf16, with
--use-distributed-optimizer and a gradient bucket smaller than the model, train two iterations, save
and load, every allocation recorded (``platform/allocation_peak``: torch's allocator records, not
the tensors held afterwards). Per parameter the rank holds bf16 values (2 bytes), fp32 main
gradients (4) and half of the fp32 main values and two moments (12 / 2): 12 bytes. Each phase
must stay under one full-size copy of what it works on: construction never holds a full fp32 copy
of the parameters (it did: 14 bytes/parameter), the reduce-scatter adds less than one fp32 gradient
copy (4; it added 10), the step less than one bf16 parameter copy (2; it added 6), a save less
than one rank's full fp32 state (12; it added 18).

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
    for rank, (bytes_of, params) in enumerate(phases):
        start, _, added = bytes_of[phase]
        added /= params
        print(f"rank {rank} {phase}: +{added:.2f} bytes/parameter over {start / params:.2f}")
        assert added < limit, f"rank {rank} {phase}: +{added:.2f} bytes/parameter (limit {limit})"


@pytest.mark.multiproc
def test_construction_holds_no_full_fp32_copy(phases):
    for rank, (bytes_of, params) in enumerate(phases):
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
        (off, params), (on, _) = plain[False][rank], plain[True][rank]
        reduce = off["reduce"][2] / params
        held_longer = (on["forward_backward"][2] - off["forward_backward"][2]) / params
        print(f"rank {rank}: reduce +{reduce:.2f} bytes/parameter; overlapped backward {held_longer:+.2f}")
        assert reduce < 1.0, f"rank {rank}: the reduction added {reduce:.2f} bytes/parameter"
        assert held_longer < 1.0, f"rank {rank}: the overlapped backward held {held_longer:.2f} bytes/parameter more"
