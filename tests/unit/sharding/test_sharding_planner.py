"""plan_sharded / perf.sharded: memory-proportional shards fit where equal ones cannot; speed-
proportional batches are predicted faster (no processes). Mode choice: tests/test_planner_modes.py."""

from __future__ import annotations

import json

import pytest

from megatron_het.cluster import CATALOG, ClusterSpec, IslandEmulation, IslandSpec, LinkSpec, ModelSpec
from megatron_het.perf.comm import ring_all_gather_time
from megatron_het.perf.flops import total_parameters
from megatron_het.perf.sharded import free_state_bytes, sharded_rank_memory, uneven_ring_s
from megatron_het.planner.errors import InfeasibleError
from megatron_het.planner.sharded import balanced_fractions, plan_sharded

GPT_6_7B = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=2048, vocab_size=50257)
SMALL = ModelSpec(num_layers=24, hidden_size=2048, num_attention_heads=32, seq_length=2048, vocab_size=50257)


def two_islands(a: str, b: str, bw: float = 100.0, *, emulation=None) -> ClusterSpec:
    return ClusterSpec(islands=(IslandSpec(name="a", device=CATALOG[a], nodes=1, gpus_per_node=4),
                                IslandSpec(name="b", device=CATALOG[b], nodes=1, gpus_per_node=4)),
                       links=(LinkSpec(between=("a", "b"), bandwidth_gbps=bw),), emulation=emulation or {})


def test_rank_memory_parts_and_uneven_ring_cost():
    p = total_parameters(SMALL)
    m = sharded_rank_memory(SMALL, shard_fraction=0.25, micro_batch_size=1, recompute=False)
    assert (m.parameters_bytes, m.gradients_bytes, m.optimizer_bytes) == (2 * p, 4 * p, 3 * p)
    assert free_state_bytes(m.total_bytes + 10, m) == m.optimizer_bytes + 10
    # equal shards: the padded ring costs exactly a ring all-gather of the full buffer
    assert uneven_ring_s(1e9 / 4, n=4, bandwidth_gbps=100, latency_us=5) == pytest.approx(
        ring_all_gather_time(1e9, n=4, bandwidth_gbps=100, latency_us=5))


def test_balanced_fractions_water_fill_under_caps():
    assert balanced_fractions([0.1, 0.5, 0.5]) == pytest.approx([0.1, 0.45, 0.45])
    assert balanced_fractions([1.0, 1.0]) == pytest.approx([0.5, 0.5])
    with pytest.raises(ValueError, match=r"caps: sum to 0\.600000, need >= 1"):
        balanced_fractions([0.3, 0.3])


def test_memory_proportional_shards_fit_where_equal_shards_cannot():
    """6.7B parameters on 4 L40S (48 GiB, fast) + 4 A100-80GB: an equal 1/8 state shard (10 GB)
    does not fit beside an L40S's working weights and gradients; memory-proportional shards do."""
    cluster = two_islands("L40S", "A100-80GB")
    with pytest.raises(InfeasibleError, match=r"rank 0 \(L40S\): an equal state shard needs 9987606528 bytes, "
                                              r"\d+ are free .*Fix: use shard_policy='memory'"):
        plan_sharded(GPT_6_7B, cluster, global_batch_size=64, shard_policy="equal")
    plan = plan_sharded(GPT_6_7B, cluster, global_batch_size=64, shard_policy="memory")
    assert plan.predicted["fits"] is True and plan.predicted["shard_policy"] == "memory"
    small, big = plan.ranks[0], plan.ranks[4]
    assert small.shard_fraction < 1 / 8 < big.shard_fraction
    # proportional to free memory after activations: the two ranks' free bytes have the same ratio
    free = []
    for r in (small, big):
        mem = sharded_rank_memory(GPT_6_7B, shard_fraction=0.0, micro_batch_size=r.micro_batch_size,
                                  recompute=r.recompute)
        free.append(free_state_bytes(int(CATALOG[r.device_type].memory_gib * 2**30), mem))
    assert small.shard_fraction / big.shard_fraction == pytest.approx(free[0] / free[1], rel=1e-9)
    assert sum(r.samples for r in plan.ranks) == 64
    json.dumps(plan.to_dict())  # JSON-serialisable, predicted included
    balanced = plan_sharded(GPT_6_7B, cluster, global_batch_size=64, shard_policy="balanced")
    assert balanced.predicted["fits"] is True  # filled to each cap, never a byte over after rounding
    assert plan.ranks[0].shard_fraction < balanced.ranks[0].shard_fraction < 1 / 8
    assert balanced.predicted["iteration_time_s"] < plan.predicted["iteration_time_s"]  # smaller largest shard
    auto = plan_sharded(GPT_6_7B, cluster, global_batch_size=64)
    assert auto.predicted["shard_policy"] in ("balanced", "memory")
    assert auto.predicted["iteration_time_s"] <= plan.predicted["iteration_time_s"]


def test_speed_proportional_batches_are_predicted_faster():
    """Emulated slowdown 3 on island b: its ranks get about a third of the samples of island a's."""
    cluster = two_islands("A100-80GB", "A100-80GB", 400, emulation={"b": IslandEmulation(slowdown=3.0)})
    fast = plan_sharded(SMALL, cluster, global_batch_size=64, micro_batch_sizes=(1,))
    even = plan_sharded(SMALL, cluster, global_batch_size=64, micro_batch_sizes=(1,), batch_policy="equal")
    assert fast.samples_per_rank == (12, 12, 12, 12, 4, 4, 4, 4)
    assert even.samples_per_rank == (8,) * 8
    gain = even.predicted["compute_s"] / fast.predicted["compute_s"]
    assert gain == pytest.approx(24 / 12, rel=1e-9)  # slowest rank: 8 x 3 units vs 12 x 1 (or 4 x 3)
    assert fast.predicted["iteration_time_s"] < even.predicted["iteration_time_s"]

