"""MoE models and plans for the parity, fresh-start and checkpoint tests of mixture-of-experts (#37).

Three small models: Mixtral's shape (SwiGLU experts, top-2 of 4, alltoall dispatcher, load-balancing and
z-loss), a mixed one (every second layer MoE, a shared expert, allgather dispatcher) and the mixed one
with token dropping at capacity 1.0. megatron-core drops tokens per rank, over the tokens the rank
routes: under sequence parallelism that is the rank's share of the sequence, so which tokens drop
depends on the TP size (in Megatron-LM as here), and the dropping model is compared on TP-1 plans only.
Four ranks, micro-batch 2, global batch 8 (4 micro-batches, uneven over replicas where a plan says so).
Plans without expert parallelism hold every expert on every replica; the ``ep*`` plans spread them
over a stage's TP ranks, over replicas, or both (docs/moe.md).
"""

from __future__ import annotations

from dataclasses import replace

from megatron_het.cluster import ModelSpec

from support.parity_plans import plan, stage

MIXTRAL_LIKE = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=32,
                         vocab_size=200, swiglu=True, add_bias_linear=False, num_experts=4, moe_router_topk=2,
                         moe_ffn_hidden_size=96, moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.01,
                         moe_z_loss_coeff=0.001, untie_embeddings_and_output_weights=True)
MIXED = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=200,
                  add_bias_linear=False, num_experts=4, moe_router_topk=2, moe_layer_freq=2,
                  moe_shared_expert_intermediate_size=64, moe_token_dispatcher_type="allgather",
                  moe_aux_loss_coeff=0.01)
DROPPING = replace(MIXED, moe_expert_capacity_factor=1.0)

CASES = {
    # two replicas of two stages, 3 vs 1 micro-batches, stage boundaries at different layers
    "pp2x3_pp2x1": plan(([stage([0], (0, 3)), stage([1], (3, 4))], 3), ([stage([2], (0, 1)), stage([3], (1, 4))], 1)),
    # experts tensor-parallel over two ranks (megatron-core needs sequence parallelism with MoE under TP)
    "tp2sp_pp2": replace(plan(([stage([0, 1], (0, 1)), stage([2, 3], (1, 4))], 4)), sequence_parallel=True),
    # TP 2 -> 1 inside a replica beside a TP-1 replica, sequence parallel, the distributed optimizer
    "tp2_tp1_x3_tp1x1_distopt": replace(plan(([stage([0, 1], (0, 2)), stage([2], (2, 4))], 3),
                                             ([stage([3], (0, 4))], 1)),
                                        sequence_parallel=True, use_distributed_optimizer=True),
    # expert parallelism (plan/experts.py): over two PP2 replicas (Megatron's EP over DP, expert-TP 1)
    "ep2_over_replicas": replace(plan(([stage([0], (0, 3)), stage([1], (3, 4))], 2),
                                      ([stage([2], (0, 3)), stage([3], (3, 4))], 2)), expert_parallel=2),
    # inside a stage: TP2 attention, experts over EP2 x expert-TP 1 of the same two ranks
    "ep2_in_tp2_stages": replace(plan(([stage([0, 1], (0, 1)), stage([2, 3], (1, 4))], 4)), sequence_parallel=True,
                                 expert_parallel=2, expert_tensor_parallel=1),
    # EP4 over two TP2 replicas (every rank holds one expert), and EP2 x expert-TP2 with the distributed optimizer
    "ep4_over_tp2_replicas": replace(plan(([stage([0, 1], (0, 4))], 2), ([stage([2, 3], (0, 4))], 2)),
                                     sequence_parallel=True, expert_parallel=4, expert_tensor_parallel=1),
    "ep2_etp2_distopt": replace(plan(([stage([0, 1], (0, 4))], 2), ([stage([2, 3], (0, 4))], 2)),
                                sequence_parallel=True, expert_parallel=2, use_distributed_optimizer=True),
    # the other schedules with EP over their replicas: interleaved 1F1B (two chunks per stage) and ZB-H1
    # (the experts' linears defer their weight gradients like the dense ones)
    "interleaved_ep2": replace(plan(([stage([0], (0, 2)), stage([1], (2, 4))], 2),
                                    ([stage([2], (0, 2)), stage([3], (2, 4))], 2)),
                               schedule="interleaved", virtual_pipeline_size=2, expert_parallel=2),
    "zb_h1_ep2": replace(plan(([stage([0], (0, 2)), stage([1], (2, 4))], 2),
                              ([stage([2], (0, 2)), stage([3], (2, 4))], 2)), schedule="zb-h1", expert_parallel=2),
}

# model name -> (model, the plans it is compared on)
MODELS = {"mixtral_like": (MIXTRAL_LIKE, tuple(CASES)), "mixed_dense_moe": (MIXED, tuple(CASES)),
          "token_dropping": (DROPPING, ("pp2x3_pp2x1", "ep2_over_replicas"))}
