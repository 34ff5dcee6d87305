"""perf.phase_memory: each phase's allocation peak, from the held state and the runtime's temporaries
(measured against the runtime by bench/memory.py and tests/multiproc/test_phase_memory.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_het.cluster import ModelSpec, load_model
from megatron_het.cluster.catalog import CATALOG
from megatron_het.perf.memory import rank_memory
from megatron_het.perf.phase_memory import PHASES, rank_phase_peaks
from megatron_het.perf.predict import bucket_parameters
from megatron_het.plan import Plan, ReplicaPlan, StagePlan

ROOT = Path(__file__).parents[3]
MODEL = ModelSpec(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=512)


def _dp(n, *, device="CPU", model_layers=4, dist=True, precision="bf16", overlap=False, attention=None) -> Plan:
    stage = lambda r: StagePlan(island="x", device_type=device, ranks=(r,), layers=(0, model_layers))  # noqa: E731
    return Plan(replicas=tuple(ReplicaPlan(stages=(stage(r),), num_micro_batches=1) for r in range(n)),
                micro_batch_size=1, global_batch_size=n, precision=precision, use_distributed_optimizer=dist,
                overlap_grad_reduce=overlap, attention=attention)


def _held(model, plan, rank=0) -> tuple[int, int]:
    m = rank_memory(model, plan, rank)
    return m.parameters_bytes + m.gradients_bytes + m.optimizer_bytes, m.parameters_bytes // 2


def test_distributed_optimizer_construction_is_the_held_state():
    """bf16, DP4: 2 + 4 + 12/4 bytes per parameter, no fp32 copy of the parameters beside them."""
    plan = _dp(4)
    steady, n = _held(MODEL, plan)
    peaks = rank_phase_peaks(MODEL, plan, 0, bucket_numel=50_000)
    assert set(peaks) == set(PHASES)
    assert peaks["construction"] == steady
    assert abs(steady - 9 * n) <= 0.001 * steady


def test_buckets_bound_the_reduction_and_the_step():
    """Halving the bucket shrinks what reduce and step add; neither adds a full fp32 gradient copy."""
    plan = _dp(4)
    steady, n = _held(MODEL, plan)
    big, small = (rank_phase_peaks(MODEL, plan, 0, bucket_numel=b) for b in (400_000, 100_000))
    for phase in ("reduce", "optimizer_step"):
        assert steady < small[phase] < big[phase] < steady + 4 * n + 4 * n // 4, phase


def test_a_gpu_rank_stages_its_checkpoint_on_the_host():
    """On the host the fp32 values and moments it writes count (12 bytes per written element); on a
    GPU they are staged in host memory and only the gathers remain."""
    plan = _dp(2)
    host = rank_phase_peaks(MODEL, plan, 0, bucket_numel=50_000, written_elements=1000)
    gpu = rank_phase_peaks(MODEL, plan, 0, bucket_numel=50_000, written_elements=1000, host_is_device=False)
    assert host["save"] - gpu["save"] == 12 * 1000
    assert gpu["load"] == _held(MODEL, plan)[0]


def test_overlapped_reduction_copies_only_reshard_buckets():
    """Replicas at one TP size reduce each bucket in place in its gradient buffer; replicas at two TP
    sizes pack zero-padded copies that live from their launch in the last backward to reduce()."""
    def plan(tps, overlap):
        stages = [StagePlan(island="x", device_type="CPU", ranks=tuple(range(2 * i, 2 * i + tp)), layers=(0, 4))
                  for i, tp in enumerate(tps)]
        return Plan(replicas=tuple(ReplicaPlan(stages=(st,), num_micro_batches=1) for st in stages),
                    micro_batch_size=1, global_batch_size=len(tps), precision="bf16", use_distributed_optimizer=True,
                    overlap_grad_reduce=overlap)

    for tps, copies in (((2, 2), False), ((2, 1), True)):
        for overlap in (False, True):
            p = plan(tps, overlap)
            steady, n = _held(MODEL, p)
            extra = rank_phase_peaks(MODEL, p, 0, bucket_numel=50_000)["forward_backward"] - steady \
                - rank_memory(MODEL, p, 0).activations_bytes
            assert extra == (4 * n if copies and overlap else 0), (tps, overlap)


def _mi250x_first_job() -> Plan:
    """The plan tools/plan.py chooses for Llama-2-7B on one MI250X node (docs/gpu.md section 5): four
    replicas of two stages, ZB-H1, the distributed optimizer with the overlapped reduction."""
    stage = lambda r, layers: StagePlan(island="x", device_type="MI250X", ranks=(r,), layers=layers)  # noqa: E731
    return Plan(replicas=tuple(ReplicaPlan(stages=(stage(2 * r, (0, 16)), stage(2 * r + 1, (16, 32))),
                                           num_micro_batches=16) for r in range(4)),
                micro_batch_size=1, global_batch_size=64, schedule="zb-h1", precision="bf16",
                use_distributed_optimizer=True, overlap_grad_reduce=True)


@pytest.mark.parametrize("device", ["H100-SXM", "MI250X"])
def test_llama2_7b_first_job_fits_every_phase(device):
    """Llama-2-7B, the plans tools/plan.py chooses for one 8-GPU node (docs/gpu.md section 5), fused
    attention: every phase under the device's memory less megatron-core's 1.5 GiB overhead, the
    forward/backward (activations, and with the overlapped reduction its in-flight copies) the largest.
    Recorded as unfused attention the same plan would not fit: s x s scores at 4k tokens."""
    model = load_model(ROOT / "examples/models/llama2-7b.yaml")
    plan = _dp(8, device=device, model_layers=model.num_layers) if device == "H100-SXM" else _mi250x_first_job()
    capacity = (CATALOG[device].memory_gib - 1.5) * 2**30
    bucket = bucket_parameters(len(plan.replicas))
    for rank in (0, 1):  # the MI250X plan's two stages
        peaks = rank_phase_peaks(model, plan, rank, bucket_numel=bucket, host_is_device=False, gloo=False)
        print(device, rank, {k: round(v / 2**30, 1) for k, v in peaks.items()})
        assert max(peaks, key=peaks.get) == "forward_backward"
        assert all(v <= capacity for v in peaks.values()), peaks
    unfused = rank_phase_peaks(model, dataclasses.replace(plan, attention="unfused"), 0, bucket_numel=bucket,
                               host_is_device=False, gloo=False)
    assert unfused["forward_backward"] > capacity
