"""A plan that does not fit because of optimizer state fits with the distributed optimizer, and the
planner says so (#15). 16 x RTX-3080 (10 GiB), a 32-layer GPT of h=3072: without the distributed
optimizer the best plan is one replica; with it two replicas, and the explanation names the stage
that would not fit unsharded (checked independently with perf.predict on the same plan, off)."""

from __future__ import annotations

import dataclasses

from megatron_het.cluster import ModelSpec, cluster_from_dict
from megatron_het.perf.predict import predict
from megatron_het.planner.search import plan_cluster

CLUSTER = cluster_from_dict({"islands": [{"name": "a", "device": "RTX-3080", "nodes": 2, "gpus_per_node": 8}]})
MODEL = ModelSpec(num_layers=32, hidden_size=3072, num_attention_heads=32, seq_length=2048, vocab_size=50257,
                  name="gpt")


def test_plan_fits_only_with_the_distributed_optimizer_and_the_planner_says_so():
    with_it = plan_cluster(MODEL, CLUSTER, global_batch_size=64, distributed_optimizer=True, recompute_options=(True,))
    best = with_it.best
    assert best.use_distributed_optimizer and len(best.replicas) == 2
    assert predict(best, MODEL, CLUSTER).fits
    assert not predict(dataclasses.replace(best, use_distributed_optimizer=False), MODEL, CLUSTER).fits
    assert "Fits only with the distributed optimizer" in with_it.explanation
    without = plan_cluster(MODEL, CLUSTER, global_batch_size=64, distributed_optimizer=False,
                           recompute_options=(True,))
    assert len(without.best.replicas) == 1  # two replicas do not fit with full optimizer state
    assert "distributed optimizer" not in without.explanation
