"""GPU memory: what the run reports is torch's allocator peak, and it is what the planner predicts
(issue 14 items 5-6; docs/gpu.md).

One GPU trains a 4-layer GPT (hidden 1024, sequence 1024, vocabulary 32k, micro-batch 2) for 3
iterations in bf16 through pretrain_gpt.py's own start-up and run (``cli.pretrain.run``, in a
spawned process that owns the device). Checked:
- the accelerator's memory statistics are ``torch.cuda.max_memory_allocated`` on the rank's device
  (not the process RSS the CPU reports);
- the peak lies within 0.5x-1.5x of perf.memory.stage_memory's prediction for that stage (no fixed
  overhead: the allocator does not see the CUDA context). The band is wide because the prediction
  ignores allocator rounding and temporary buffers; a model counting fp32 weights as bf16, or
  forgetting the optimizer state, falls outside it.
"""

from __future__ import annotations

import pickle

import pytest
import torch.multiprocessing as mp

from megatron_het.cluster import ModelSpec
from megatron_het.perf.memory import stage_memory
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.platform.local_launch import free_port

from support.gpu_run import MODEL_FILE, native_device, need_gpus, write_cluster
from workers.gpu_workers import pretrain_memory_worker

pytestmark = pytest.mark.gpu
# every field the tiny model file sets or derives is overridden, so the run and the prediction agree
SHAPE = dict(num_layers=4, hidden_size=1024, num_attention_heads=16, num_query_groups=16, ffn_hidden_size=4096,
             seq_length=1024, max_position_embeddings=1024)
VOCAB, MICRO, ITERS = 32000, 2, 3


def test_peak_memory_is_the_allocators_and_matches_the_prediction(tmp_path):
    need_gpus(1)
    Plan(replicas=(ReplicaPlan(stages=(StagePlan(island="gpu", device_type=native_device(), ranks=(0,),
                                                 layers=(0, 4)),), num_micro_batches=1),),
         micro_batch_size=MICRO, global_batch_size=MICRO, precision="bf16").save(tmp_path / "plan.json")
    cluster = write_cluster(tmp_path / "cluster.json", [("gpu", native_device(), 1)])
    argv = ["--hetero-cluster", str(cluster), "--hetero-model", str(MODEL_FILE), "--hetero-plan",
            str(tmp_path / "plan.json"), "--micro-batch-size", str(MICRO), "--global-batch-size", str(MICRO),
            "--train-iters", str(ITERS), "--log-interval", "1", "--mock-data", "--no-emulation", "--bf16",
            "--vocab-size", str(VOCAB), *[a for k, v in SHAPE.items() for a in (f"--{k.replace('_', '-')}", str(v))]]
    mp.spawn(pretrain_memory_worker, args=(1, argv, free_port(), str(tmp_path / "rank0.pkl")), nprocs=1)
    out = pickle.loads((tmp_path / "rank0.pkl").read_bytes())
    model = ModelSpec(vocab_size=VOCAB, **SHAPE)
    predicted = stage_memory(model, num_layers=4, is_first=True, is_last=True, micro_batch_size=MICRO,
                             microbatches_in_flight=1, distributed_optimizer=False, overhead_bytes=0,
                             precision="bf16")
    gib = 2 ** 30
    print(f"{out['device']}: max allocated {out['max_allocated'] / gib:.3f} GiB, reserved "
          f"{out['max_reserved'] / gib:.3f} GiB of {out['capacity'] / gib:.1f} GiB; predicted "
          f"{predicted.total_bytes / gib:.3f} GiB {({k: round(v / gib, 3) for k, v in predicted.parts().items()})}")
    assert len(out["losses"]) == ITERS
    assert out["reported_max_allocated"] == out["max_allocated"], "the run's memory figure is not the allocator's"
    assert 0 < out["max_allocated"] <= out["max_reserved"] <= out["capacity"]
    assert 0.5 * predicted.total_bytes <= out["max_allocated"] <= 1.5 * predicted.total_bytes
