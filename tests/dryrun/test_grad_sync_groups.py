"""The gradient synchronizer's groups on the 768-rank tangram plan and the 480-rank uneven-TP plan,
rank by rank on torch's fake backend (tests/support/fake_grad_sync.py).

Every rank's holdings come from ``runtime/holdings.plan_holdings`` (megatron-core's stages built on the
meta device, once per stage shape); each sampled rank then runs ``GradientSynchronizer``'s own
constructor with the gather answered from them. Checked: every sampled rank creates the same groups in
the same order (one per bucket of ``plan_buckets``, as a real launch needs), each rank keeps exactly the
groups of the buckets it is in, with those members, and its buckets hold each of its parameters once.
Also with megatron's default bucket size (the overlapped synchronizer's constructor path:
``OverlappedGradientSynchronizer`` is this constructor plus gradient hooks), and the distributed
optimizer's groups (its own shard buckets, ``plan_shard_buckets``) on the tangram plan, on one rank of
each of its three buckets (~0.5 s a rank).

Not covered: the cross-vendor bridge's own sub-groups. The uneven plan's NVIDIA and AMD islands share
every bucket, so a real launch routes them through ``new_bridge_group`` (gloo and the accelerators'
backends, which a fake world cannot create); which buckets are bridged is asserted, and the simulation
creates them as native groups. The distributed optimizer is simulated on the tangram plan only (TP 1:
its meta parameters take the holdings' full shapes).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_het.cluster import ModelSpec, load_cluster, load_model
from megatron_het.optim.holders import plan_shard_buckets
from megatron_het.perf.predict import bucket_parameters
from megatron_het.plan import load_any_plan
from megatron_het.runtime.comm_routing import rank_placement
from megatron_het.runtime.grad_sync import plan_buckets
from megatron_het.runtime.holdings import plan_holdings

from support.dryrun_plans import NV_RANKS, uneven_plan
from support.fake_grad_sync import (
    answer_gather_with,
    bridged_buckets,
    by_rank,
    catalog_placement,
    dist_opt_view,
    grad_sync_problems,
    grad_sync_view,
    group_ranks,
)
from support.fake_world import TIMEOUT, creation_order_mismatch, sample_ranks, simulate_ranks

ROOT = Path(__file__).parents[2]
# the uneven plan's model: tied (the word embedding is held by first and last stages of both layouts)
# and not gated (a 3D stage has no SwiGLU layer)
UNEVEN_MODEL = ModelSpec(num_layers=32, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=50257)


def _world(plan, model):
    gathered = by_rank(plan_holdings(plan, model), plan.world_size)
    return plan, gathered, plan_buckets([h for hs in gathered for h in hs])


@pytest.fixture(scope="module")
def tangram():
    return _world(load_any_plan(Path(__file__).parent / "tangram1024_llama2_7b_gbs2048.json"),
                  load_model(ROOT / "examples/models/llama2-7b.yaml"))


@pytest.fixture(scope="module")
def uneven():
    return _world(uneven_plan(), UNEVEN_MODEL)


def _simulate(world, monkeypatch, **kwargs):
    plan, gathered, _ = world
    answer_gather_with(monkeypatch, gathered)
    return simulate_ranks(plan, sample_ranks(plan), grad_sync_view(gathered, timeout=TIMEOUT, **kwargs), monkeypatch)


def _check(sims, expected):
    assert creation_order_mismatch(sims) is None
    for sim in sims.values():  # one group per distinct bucket rank set, in bucket order, with the run's timeout
        assert group_ranks(sim.creations) == list(dict.fromkeys(b.ranks for b in expected))
        assert {c[2] for c in sim.creations} == {TIMEOUT}
    assert [p for r, sim in sims.items() for p in grad_sync_problems(r, sim.result, expected)] == []


def test_tangram_sampled_ranks_create_every_bucket_group_in_one_order(tangram, monkeypatch):
    plan, gathered, expected = tangram
    # every rank holds its stage's parameters: embedding + 5 layers | 14 layers | 13 layers + norm + output
    assert sorted({len(hs) for hs in gathered}) == [31, 80, 84]
    # TP = 1 everywhere, untied: each stage position's 256 copies reduce directly, one group each
    assert [(len(b.ranks), b.direct) for b in expected] == [(256, True)] * 3
    assert bridged_buckets(expected, rank_placement(plan, load_cluster(ROOT / "examples/clusters/tangram-1024.yaml"))) == []
    _check(_simulate(tangram, monkeypatch), expected)


def test_tangram_with_default_bucket_size(tangram, monkeypatch):
    plan, gathered, _ = tangram
    size = bucket_parameters(len(plan.replicas))
    expected = plan_buckets([h for hs in gathered for h in hs], bucket_numel=size)
    assert len(expected) > 3  # buckets split the stages' groups
    _check(_simulate(tangram, monkeypatch, bucket_numel=size), expected)


def test_tangram_distributed_optimizer_groups(tangram, monkeypatch):
    plan, gathered, _ = tangram
    expected = [b.ranks for b in plan_shard_buckets([h for hs in gathered for h in hs]) if len(b.ranks) > 1]
    ranks = [0, 511, 767]  # one rank of each bucket (H100 stages 1 and 2, A100 stage 0)
    assert len(expected) == 3 and all(sum(r in b for r in ranks) == 1 for b in expected)
    answer_gather_with(monkeypatch, gathered)
    sims = simulate_ranks(plan, ranks, dist_opt_view(gathered, timeout=TIMEOUT), monkeypatch)
    assert creation_order_mismatch(sims) is None
    assert group_ranks(sims[0].creations) == expected
    for r, sim in sims.items():
        assert sim.result["buckets"] == expected
        assert sim.result["groups"] == [(b, b) for b in expected if r in b]


def test_uneven_tp_sampled_ranks_create_every_bucket_group_in_one_order(uneven, monkeypatch):
    plan, gathered, expected = uneven
    tied = [b for b in expected if "embedding.word_embeddings.weight" in b.names]
    assert len(tied) == 1 and tied[0].ranks == tuple(range(480))  # TP 2, TP 4 and a 2x2x1 grid hold it
    assert not any(b.direct for b in expected)  # holders of every parameter differ in TP size or are 3D
    # the buckets NVIDIA and AMD ranks share are bridged on a real launch (simulated as native groups);
    # layers 10-16 are held by AMD stages only (A's TP 4 and B's grid)
    bridged = bridged_buckets(expected, catalog_placement(plan))
    assert [b.ranks for b in bridged] == [b.ranks for b in expected if b.ranks[0] < NV_RANKS] and len(bridged) == 3
    sims = _simulate(uneven, monkeypatch)
    assert any(h.grid is not None for r in sims for h in gathered[r])  # the sample reaches 3D stages
    _check(sims, expected)
