"""Pipeline transfers far larger than NCCL's/RCCL's internal buffer (schedule/transfers.py).

A group's sends and receives between two ranks run on one stream in issue order, and in 1F1B,
ZB-H1 and interleaved 1F1B both sides of a boundary reach a send at once. Unbatched, on one group,
that hangs as soon as a message outgrows the library's buffer (a few MiB), which the tiny parity
models never reach: here each activation is 2,048 tokens x 2 sequences x hidden 2,048 in fp32,
32 MiB. The runtime posts each step's send with the crossing receive in one ``batch_isend_irecv``
on the boundary's one group; these runs must finish (a hang ends at --distributed-timeout-minutes)
with finite losses. tests/unit/schedule/test_transfer_streams.py models NCCL's weakest promise on the
CPU and shows the unbatched deadlock.
"""

from __future__ import annotations

import json
import math

import pytest

from megatron_het.plan import Plan, ReplicaPlan, StagePlan

from support.gpu_run import native_device, need_gpus, pretrain, write_cluster

pytestmark = pytest.mark.gpu

WIDE = {"name": "wide-4layer", "num_layers": 4, "hidden_size": 2048, "num_attention_heads": 16, "seq_length": 2048,
        "vocab_size": 512}


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved"])
def test_large_activations_cross_a_two_stage_boundary(tmp_path, schedule):
    need_gpus(2)
    dev = native_device()
    model = tmp_path / "wide.yaml"
    model.write_text(json.dumps(WIDE))  # JSON is YAML
    plan = tmp_path / "plan.json"
    chunks = ({"chunk_layers": ((0, 1), (2, 3))}, {"chunk_layers": ((1, 2), (3, 4))}) if schedule == "interleaved" \
        else ({}, {})
    Plan(replicas=(ReplicaPlan(stages=(StagePlan(island="gpu", device_type=dev, ranks=(0,), layers=(0, 2), **chunks[0]),
                                       StagePlan(island="gpu", device_type=dev, ranks=(1,), layers=(2, 4), **chunks[1])),
                               num_micro_batches=4),),
         micro_batch_size=2, global_batch_size=8, precision="fp32", schedule=schedule,
         virtual_pipeline_size=2 if schedule == "interleaved" else 1).save(plan)
    cluster = write_cluster(tmp_path / "cluster.yaml", [("gpu", dev, 2)])
    run = pretrain(2, cluster, plan, "--distributed-timeout-minutes", "3", iters=2, model=model)
    assert len(run.losses) == 2 and all(math.isfinite(x) for x in run.losses), run.output[-3000:]
