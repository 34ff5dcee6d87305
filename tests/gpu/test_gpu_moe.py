"""Mixture-of-experts plans on real GPUs train like one GPU (#37; docs/moe.md).

Megatron-LM's Mixtral MoE flags (4 experts, top-2, alltoall dispatcher, load-balancing and z-loss,
no linear biases) on tests/support/gpu_run.py's tiny model, through ``torchrun pretrain_gpt.py``
on one island of this node's GPUs (NCCL, or RCCL through torch's ``nccl`` backend on ROCm). Each run
starts from the seed alone (the initial model is plan-independent) and trains 5 iterations; every loss
must match the one-GPU run of the same flags within 1e-5 relative in fp32, the dense GPU suite's
tolerance (tests/gpu/test_gpu_parity.py: the same arithmetic up to reduction order; the CPU suite
measures <= 1e-7 for these placements, tests/multiproc/test_moe_parity.py). With transformer-engine
installed the stages use its layer spec (experts as TE linears in SequentialMLP), the CPU suite
megatron-core's local one: this is where the two meet.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_het.plan import Plan, ReplicaPlan, StagePlan

from support.gpu_run import assert_close, native_device, need_gpus, pretrain, write_cluster

pytestmark = pytest.mark.gpu

MOE_FLAGS = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
             "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--disable-bias-linear")


def moe_plan(replicas, *, dev: str | None = None, **fields) -> Plan:
    """``replicas``: ([(ranks, layers), ...], micro-batches) each; 4 micro-batches of 2 in all, fp32."""
    dev = dev or native_device()
    return dataclasses.replace(Plan(
        replicas=tuple(ReplicaPlan(stages=tuple(StagePlan(island="gpu", device_type=dev, ranks=tuple(r), layers=layers)
                                                for r, layers in stages), num_micro_batches=m)
                       for stages, m in replicas),
        micro_batch_size=2, global_batch_size=8, precision="fp32"), **fields)


# name -> (GPUs, replicas, plan fields)
PLANS = {
    "one_gpu": (1, [([([0], (0, 4))], 4)], {}),
    "experts_on_both_replicas": (2, [([([0], (0, 4))], 2), ([([1], (0, 4))], 2)], {}),
    "ep2_over_replicas": (2, [([([0], (0, 4))], 2), ([([1], (0, 4))], 2)], {"expert_parallel": 2}),
    "ep2_in_a_tp2_stage": (2, [([([0, 1], (0, 4))], 4)], {"sequence_parallel": True, "expert_parallel": 2,
                                                          "expert_tensor_parallel": 1}),
    "ep2_in_tp2_stages_pp2": (4, [([([0, 1], (0, 2)), ([2, 3], (2, 4))], 4)],
                                 {"sequence_parallel": True, "expert_parallel": 2, "expert_tensor_parallel": 1}),
    "ep2_etp2_over_tp2_replicas": (4, [([([0, 1], (0, 4))], 2), ([([2, 3], (0, 4))], 2)],
                                   {"sequence_parallel": True, "expert_parallel": 2}),
}
_REFERENCE: list[float] = []


def _run(tmp_path, name):
    gpus, replicas, fields = PLANS[name]
    need_gpus(gpus)
    moe_plan(replicas, **fields).save(tmp_path / f"{name}.json")
    cluster = write_cluster(tmp_path / f"{name}-cluster.json", [("gpu", native_device(), gpus)])
    return pretrain(gpus, cluster, tmp_path / f"{name}.json", *MOE_FLAGS)


@pytest.mark.parametrize("name", [n for n in PLANS if n != "one_gpu"])
def test_moe_plan_matches_one_gpu(tmp_path_factory, name):
    if not _REFERENCE:
        _REFERENCE.extend(_run(tmp_path_factory.mktemp("moe-reference"), "one_gpu").losses)
    run = _run(tmp_path_factory.mktemp(name), name)
    assert "load_balancing_loss" in run.output, run.output[-3000:]
    assert_close(f"MoE {name} on {PLANS[name][0]} GPUs", run.losses, _REFERENCE, 1e-5)
