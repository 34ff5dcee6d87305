"""The allocation peak of each phase of a pipeline-runtime rank: what ``perf.memory.rank_memory``
holds, plus what each phase makes and frees (issue #36 item 4).

``rank_memory`` gives the state a rank holds between steps (weights, gradients, optimizer state)
and the activations at the schedule's peak; a phase's peak adds its own temporaries, which are the
runtime's, so they are priced from its code:

- construction: the model is built in fp32 and cast to bf16/fp16 (both alive for a moment), then
  the main gradients and the optimizer state are made; the fp32 distributed optimizer takes its
  fp32 pieces from the parameters once (kept only during a step afterwards); the plain optimizer's
  Adam moments appear at the first step, not here;
  a direct bucket's fp32 gradients (every holder at one TP size: ``runtime/grad_sync.py``) are made
  here (where the plain fp32 path would make them at the first step) and moved into the bucket's
  buffer, the buffer and the bucket's gradients alive together for a moment;
- forward/backward: the held state and the activations;
- with ``--overlap-grad-reduce`` (the plan's ``overlap_grad_reduce``): a direct bucket is all-reduced
  in place in its buffer; a reshard bucket (holders at several TP sizes) is packed into a zero-padded
  flat copy when the last backward completes it, which lives until ``reduce()`` waits for it, so the
  end of the forward/backward and the reduction hold one fp32 copy of the rank's gradients more
  (counted whole: most buckets complete before the wait);
- gradient reduction: the distributed optimizer's reduced pieces (fp32, kept until the step) and,
  per bucket, its owner-ordered fp32 buffer and the collective's pieces (gloo reduces per owner:
  this rank's piece and one other owner's; NCCL reduce-scatters from the buffer); the plain
  synchronizer reduces a direct bucket in place and packs a reshard bucket's zero-padded full
  tensors into one flat buffer;
- optimizer step: the reduced pieces and, per bucket, the all-gather's buffers in the parameters'
  dtype (this rank's piece cast, its padded copy, every owner's padded piece, their concatenation)
  and one parameter's block; fp32 takes its fp32 pieces from the parameters for the step; the plain
  optimizer (torch's single-tensor AdamW) makes two temporaries of its largest parameter;
- save: the parameters this rank writes, fp32 values and both moments, staged on the host (device
  memory on a GPU only for the gathers: ``host_is_device`` False), and the gathers in fp32;
- load: fp32 values and both moments of the local parameters read into host buffers, one group of
  ``utils.read_budget.READ_GROUP_BYTES`` at a time (a parameter larger than that alone).

The buckets are ``bucket_numel`` elements (``--ddp-bucket-size``; closed at the first parameter
that reaches it), so the largest is taken as ``max(bucket_numel, largest parameter)``, at most the
rank's parameters. Checkpoint writing is spread over the holding stages
(``grad_sync.checkpoint_writers``): a rank writes about ``1/stages holding its layers`` of them.
Not counted: megatron-core's and torch.distributed.checkpoint's own buffers while writing and
reading files, the allocator's rounding, anything below a kilobyte.
"""

from __future__ import annotations

import dataclasses

from megatron_het.cluster import ModelSpec
from megatron_het.perf.memory import rank_memory, runtime_state_bytes
from megatron_het.utils.read_budget import READ_GROUP_BYTES

__all__ = ["PHASES", "largest_local_parameter", "rank_phase_peaks"]

PHASES = ("construction", "forward_backward", "reduce", "optimizer_step", "save", "load")


def largest_local_parameter(model: ModelSpec, *, tp: int, has_embedding: bool, has_output: bool,
                            num_layers: int) -> int:
    """Elements of the largest tensor one TP rank of a stage holds."""
    # an MoE layer holds each expert as its own tensors (one expert's width; a dense layer's beside it)
    h, f, d = model.hidden_size, max(model.ffn_hidden_size, model.moe_ffn_hidden_size or 0), model.kv_channels
    sizes = [0]
    if num_layers:
        sizes += [h * f * (2 if model.swiglu else 1) // tp, f * h // tp,
                  h * (model.num_attention_heads + 2 * model.num_query_groups) * d // tp,
                  model.num_attention_heads * d * h // tp]
    if has_embedding or has_output:
        sizes.append(model.vocab_size // tp * h)
    if has_embedding and model.position_embedding_type == "learned_absolute":
        sizes.append((model.max_position_embeddings or model.seq_length) * h)
    return max(sizes)


def rank_phase_peaks(model: ModelSpec, plan, rank: int, *, bucket_numel: int, precision: str | None = None,
                     padded_vocab: int | None = None, weights: dict[int, float] | None = None,
                     host_is_device: bool = True, gloo: bool = True,
                     written_elements: int | None = None) -> dict[str, int]:
    """Phase -> predicted allocation peak (bytes) on ``rank`` of ``plan`` (``PHASES``).

    ``bucket_numel``: the run's gradient bucket (``--ddp-bucket-size`` or megatron-core's default);
    ``host_is_device``: the rank computes on the host (checkpoint staging counts); ``gloo``: its
    collectives are gloo's (the per-owner reduce); ``written_elements``: the parameter elements this
    rank writes into a checkpoint (``grad_sync.checkpoint_writers`` over ``runtime.holdings.plan_holdings``;
    None: its elements over the replicas)."""
    from megatron_het.plan import rank_roles

    precision = precision or plan.precision
    held = rank_memory(model, plan, rank, precision=precision, padded_vocab=padded_vocab, weights=weights)
    role = rank_roles(plan)[rank]
    replica = plan.replicas[role.replica]
    st = replica.stages[role.stage]
    w, g, o = runtime_state_bytes(precision, distributed_optimizer=plan.use_distributed_optimizer)
    mixed = w < 4
    n = held.parameters_bytes // w  # parameter elements on this rank
    steady = held.parameters_bytes + held.gradients_bytes + held.optimizer_bytes
    vmodel = dataclasses.replace(model, vocab_size=padded_vocab) if padded_vocab else model
    tied = not model.untie_embeddings_and_output_weights
    is_first, is_last = role.stage == 0, role.stage == len(replica.stages) - 1
    largest = largest_local_parameter(vmodel, tp=st.tp, has_embedding=is_first or (is_last and tied),
                                      has_output=is_last and not tied, num_layers=st.num_layers)
    bucket = min(n, max(bucket_numel, largest))
    written = n // max(1, len(plan.replicas)) if written_elements is None else written_elements
    staged = 12 * written if host_is_device else 0  # fp32 values + 2 moments of what it writes
    # direct buckets only when every holder has one TP size (else the tied embedding and the layers reshard)
    reshaped = len({s.tp for r in plan.replicas for s in r.stages}) > 1
    if len(plan.replicas) > 1:  # reduced elements: every one across replicas
        shared = n
    else:  # in one replica the tied word embedding (first and last stage) and, under TP, replicated ones
        from megatron_het.perf.flops import replicated_layer_parameters

        embedding = vmodel.vocab_size // st.tp * model.hidden_size
        shared = (embedding if tied and len(replica.stages) > 1 and (is_first or is_last) else 0) + (
            st.num_layers * replicated_layer_parameters(model) if st.tp > 1 else 0)
    # a direct bucket's buffer beside its gradients while they move in; fp32 .grad are made for it first
    adopting = 0 if reshaped else 4 * min(bucket, shared) + (0 if mixed else 4 * shared)
    in_flight = 4 * n if plan.overlap_grad_reduce and reshaped else 0  # packed copies, launch to reduce()
    out = {"forward_backward": steady + held.activations_bytes + in_flight,
           "load": steady + (min(12 * n, max(READ_GROUP_BYTES, 12 * largest)) if host_is_device else 0)}
    if plan.use_distributed_optimizer:
        s = held.optimizer_bytes // o  # elements of this rank's pieces
        share = s / n if n else 0.0  # its share of each bucket
        pieces = 4 * s  # the reduced fp32 gradient pieces, from the reduce to the step
        if mixed:
            out["construction"] = max(6 * n, w * n + g * n + o * s)
        else:  # the fp32 pieces are taken from the parameters once while the optimizer is built
            out["construction"] = w * n + o * s + max(4 * s, adopting if plan.overlap_grad_reduce else 0)
        collective = 4 * bucket * (2 * share if gloo else share)  # this rank's piece (+ one other owner's)
        # with the overlapped reducer: its reshard copies, then this rank's pieces taken from the sums
        out["reduce"] = steady + pieces + (in_flight if plan.overlap_grad_reduce else 4 * bucket + int(collective))
        gather = int(w * bucket * (2 + 2 * share)) + w * largest  # piece, padded, owners' padded, joined; a block
        out["optimizer_step"] = steady + pieces + (0 if mixed else 4 * s) + gather
        out["save"] = steady + staged + int(4 * bucket * (2 + 2 * share)) + 4 * largest
    else:
        out["construction"] = (w + (8 if mixed else 0)) * n + adopting  # MainParams: fp32 values, gradients
        # a reshard bucket's zero-padded full tensors and their concatenation; direct buckets in place
        out["reduce"] = steady + (in_flight or (8 * min(bucket, shared) if reshaped else 0))
        out["optimizer_step"] = steady + 2 * 4 * largest
        out["save"] = steady
    return {p: int(out[p]) for p in PHASES}
