"""perf.memory.rank_memory and optimizer_shard_weights against independent figures (#15)."""

from __future__ import annotations

import dataclasses

from megatron_het.cluster import ModelSpec
from megatron_het.perf.flops import stage_parameters
from megatron_het.perf.memory import optimizer_shard_weights, rank_memory
from megatron_het.plan import Plan, ReplicaPlan, StagePlan

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=512,
                  untie_embeddings_and_output_weights=True)


def _plan(device_b="CPU", dist=False, precision="fp32") -> Plan:
    def replica(first, device):
        return ReplicaPlan(stages=(StagePlan(island="a", device_type=device, ranks=(first, first + 1), layers=(0, 2)),
                                   StagePlan(island="a", device_type=device, ranks=(first + 2, first + 3),
                                             layers=(2, 4))), num_micro_batches=2)
    return Plan(replicas=(replica(0, "CPU"), replica(4, device_b)), micro_batch_size=1, global_batch_size=4,
                use_distributed_optimizer=dist, precision=precision)


def test_state_bytes_follow_the_runtimes_bytes_per_parameter():
    for rank, first, last in ((0, True, False), (2, False, True)):
        params = stage_parameters(MODEL, num_layers=2, is_first=first, is_last=last, tp=2)
        fp32 = rank_memory(MODEL, _plan(), rank)
        assert (fp32.parameters_bytes, fp32.gradients_bytes, fp32.optimizer_bytes) == (4 * params, 4 * params,
                                                                                      8 * params)
        bf16 = rank_memory(MODEL, _plan(precision="bf16"), rank)
        assert (bf16.parameters_bytes, bf16.gradients_bytes, bf16.optimizer_bytes) == (2 * params, 4 * params,
                                                                                      12 * params)


def test_distributed_optimizer_splits_state_over_every_holder():
    """Two equal replicas of TP2 stages: a TP-partitioned element has 2 holders, a replicated one
    (norms, row-parallel biases, position embeddings, final norm) 4 (both TP ranks of both replicas)."""
    h = MODEL.hidden_size
    per_layer_replicated = 2 * h + 2 * (2 * h)  # proj and fc2 biases; two LayerNorms (weight + bias)
    replicated = {0: 2 * per_layer_replicated + MODEL.seq_length * h,  # + position embeddings
                  2: 2 * per_layer_replicated + 2 * h}  # + final LayerNorm
    for rank in (0, 2):
        plain, dist = rank_memory(MODEL, _plan(), rank), rank_memory(MODEL, _plan(dist=True), rank)
        params = plain.optimizer_bytes // 8
        expected = 8 * ((params - replicated[rank]) / 2 + replicated[rank] / 4)
        assert abs(dist.optimizer_bytes - expected) <= 1, (rank, dist.optimizer_bytes, expected)


def test_weights_follow_device_memory_and_fall_back_to_equal_for_unknown_types():
    w = optimizer_shard_weights(MODEL, _plan(device_b="A100-80GB"))
    assert w[4] > w[0]  # 80 GiB beside the 16 GiB CPU entry
    uneven = rank_memory(MODEL, _plan(device_b="A100-80GB", dist=True), 4)
    even = rank_memory(MODEL, _plan(dist=True), 4)
    assert uneven.optimizer_bytes > even.optimizer_bytes  # the bigger device takes the larger share
    custom = optimizer_shard_weights(MODEL, dataclasses.replace(_plan(device_b="MY-GPU")))
    assert set(custom.values()) == {1.0}


def test_weights_count_the_executed_schedules_activations_and_the_overlap_copies():
    """The free memory behind the shares is the device's less what the runtime holds at its peak: the
    activations of the schedule it executes (interleaving keeps more micro-batch chunks on stage 0 than
    1F1B's count, which the weights used to assume) and, with --overlap-grad-reduce, every bucket's packed
    gradient copy. Each difference is checked against rank_memory, the runtime's own component model."""
    model = dataclasses.replace(MODEL, num_layers=8)

    def plan(**kw):
        def replica(first):
            return ReplicaPlan(stages=(StagePlan(island="a", device_type="A100-80GB", ranks=(first,), layers=(0, 4)),
                                       StagePlan(island="a", device_type="A100-80GB", ranks=(first + 1,),
                                                 layers=(4, 8))), num_micro_batches=4)
        return Plan(replicas=(replica(0), replica(2)), micro_batch_size=1, global_batch_size=8,
                    use_distributed_optimizer=True, **kw)

    flat, inter = plan(), plan(schedule="interleaved", virtual_pipeline_size=2)
    w_flat, w_inter = optimizer_shard_weights(model, flat), optimizer_shard_weights(model, inter)
    extra = rank_memory(model, inter, 0).activations_bytes - rank_memory(model, flat, 0).activations_bytes
    assert extra > 0  # stage 0 holds 5 chunk micro-batches of 2 layers (1F1B: 2 of 4 layers)
    assert w_flat[0] - w_inter[0] == extra
    overlapped = optimizer_shard_weights(model, plan(overlap_grad_reduce=True))
    assert w_flat[1] - overlapped[1] == rank_memory(model, flat, 1).gradients_bytes
