"""Pure pieces of the runtime: boundary pairing, gradient buckets, norm ownership, vocab padding."""

from __future__ import annotations

import pytest

from megatron_het.cluster import ModelSpec
from megatron_het.plan import Plan, ReplicaPlan, StagePlan
from megatron_het.runtime.boundary import receivers_of, sender_for
from megatron_het.runtime.grad_sync import Holding, owned_norm_holdings, plan_buckets
from megatron_het.runtime.hetero_trainer import plan_padded_vocab, replica_first_micro_batch
from megatron_het.runtime.stage_groups import check_contiguous_stages


@pytest.mark.parametrize("a,b", [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (3, 2), (2, 3)])
def test_every_receiver_has_exactly_one_sender(a, b):
    served = sorted(j for i in range(a) for j in receivers_of(i, a, b))
    assert served == list(range(b))
    for j in range(b):
        assert j in receivers_of(sender_for(j, a), a, b)


def test_sends_are_spread_over_senders():
    # 4 -> 2: only two senders are needed; 2 -> 4: each sender serves two receivers
    assert [receivers_of(i, 4, 2) for i in range(4)] == [[0], [1], [], []]
    assert [receivers_of(i, 2, 4) for i in range(2)] == [[0, 2], [1, 3]]


def h(name, rank, stage, tp_rank, tp, dim, shape=(8, 4)):
    return Holding(name=name, rank=rank, stage_key=stage, tp_rank=tp_rank, tp_size=tp, partition_dim=dim,
                   full_shape=shape)


def test_same_layout_replicas_reduce_directly_per_tp_rank():
    hs = [h("w", 0, (0, 0), 0, 2, 0), h("w", 1, (0, 0), 1, 2, 0),
          h("w", 2, (1, 0), 0, 2, 0), h("w", 3, (1, 0), 1, 2, 0)]
    buckets = plan_buckets(hs)
    assert [(b.ranks, b.names, b.direct) for b in buckets] == [((0, 2), ("w",), True), ((1, 3), ("w",), True)]


def test_different_tp_sizes_reshard_through_full_buffer():
    hs = [h("w", 0, (0, 0), 0, 1, 0), h("w", 1, (1, 0), 0, 2, 0), h("w", 2, (1, 0), 1, 2, 0),
          h("ln", 0, (0, 0), 0, 1, None, (4,)), h("ln", 1, (1, 0), 0, 2, None, (4,)),
          h("ln", 2, (1, 0), 1, 2, None, (4,))]
    buckets = plan_buckets(hs)
    assert len(buckets) == 1 and buckets[0].ranks == (0, 1, 2) and not buckets[0].direct
    assert buckets[0].names == ("ln", "w")  # deterministic order


def test_single_stage_parameters_need_no_reduction():
    assert plan_buckets([h("w", 0, (0, 0), 0, 2, 0), h("w", 1, (0, 0), 1, 2, 0)]) == []


def test_norm_counts_each_full_element_once():
    hs = [h("w", 0, (0, 0), 0, 2, 0), h("w", 1, (0, 0), 1, 2, 0), h("w", 2, (1, 0), 0, 1, 0),
          h("ln", 0, (0, 0), 0, 2, None), h("ln", 1, (0, 0), 1, 2, None), h("ln", 2, (1, 0), 0, 1, None)]
    assert owned_norm_holdings(hs) == {("w", 0), ("w", 1), ("ln", 0)}


def _stage(ranks, layers):
    return StagePlan(island="fast", device_type="CPU", ranks=tuple(ranks), layers=layers)


def test_padded_vocab_and_micro_batch_offsets():
    plan = Plan(replicas=(ReplicaPlan(stages=(_stage([0], (0, 2)), _stage([1, 2, 3], (2, 4))), num_micro_batches=3),
                          ReplicaPlan(stages=(_stage([4, 5], (0, 4)),), num_micro_batches=1)),
                micro_batch_size=2, global_batch_size=8)
    model = ModelSpec(num_layers=4, hidden_size=96, num_attention_heads=6, seq_length=8, vocab_size=1000)
    assert plan_padded_vocab(model, plan) == 1536  # multiple of 128 * lcm(1, 3, 2) = 768
    assert [replica_first_micro_batch(plan, r) for r in (0, 1)] == [0, 3]


def test_non_contiguous_stage_ranks_are_refused_with_the_fix():
    plan = Plan(replicas=(ReplicaPlan(stages=(_stage([0, 2], (0, 2)), _stage([1, 3], (2, 4))), num_micro_batches=4),),
                micro_batch_size=2, global_batch_size=8)
    with pytest.raises(ValueError, match=r"replicas\[0\]\.stages\[0\]\.ranks.*consecutive.*\[0, 1\]"):
        check_contiguous_stages(plan)


def _written(writers, hs):
    """name -> elements written, and rank -> elements it writes (partitioned: its TP block)."""
    import math

    per_name, per_rank = {}, {}
    for x in hs:
        if (x.name, x.rank) in writers:
            n = math.prod(x.full_shape) // (x.tp_size if x.partition_dim is not None else 1)
            per_name[x.name] = per_name.get(x.name, 0) + n
            per_rank[x.rank] = per_rank.get(x.rank, 0) + n
    return per_name, per_rank


def test_checkpoint_writers_write_every_element_once_spread_over_replicas():
    """Each parameter is written by one stage (all its TP ranks for a partitioned tensor, TP rank 0
    for a replicated one), so every element once; the stages are chosen to spread the bytes: over
    four replicas (TP1, TP2, TP1, TP4) no rank writes more than a third of the model, where the norm's
    ownership (the first replica) would make rank 0 write all of it."""
    import math

    from megatron_het.runtime.grad_sync import checkpoint_writers
    from megatron_het.runtime.holdings import plan_holdings

    model = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=256)
    plan = Plan(replicas=(ReplicaPlan(stages=(_stage([0], (0, 4)),), num_micro_batches=1),
                          ReplicaPlan(stages=(_stage([1, 2], (0, 4)),), num_micro_batches=1),
                          ReplicaPlan(stages=(_stage([3], (0, 4)),), num_micro_batches=1),
                          ReplicaPlan(stages=(_stage([4, 5, 6, 7], (0, 4)),), num_micro_batches=1)),
                micro_batch_size=1, global_batch_size=4)
    hs = plan_holdings(plan, model)
    writers = checkpoint_writers(hs)
    per_name, per_rank = _written(writers, hs)
    full = {x.name: math.prod(x.full_shape) for x in hs}
    assert per_name == full  # every parameter, every element once
    for name in full:  # one stage per parameter
        assert len({x.stage_key for x in hs if (x.name, x.rank) in writers and x.name == name}) == 1, name
    total = sum(full.values())
    assert max(per_rank.values()) <= total / 3, (per_rank, total)
    _, norm_rank = _written(owned_norm_holdings(hs), hs)
    assert norm_rank == {0: total}  # what the checkpoint used to write on rank 0 alone
