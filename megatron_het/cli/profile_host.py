"""Measure per-layer forward/backward time and memory on this machine; write a profile JSON.

    python tools/profile_host.py --num-layers 2 --hidden-size 256 --num-attention-heads 4 \\
        --seq-length 128 --micro-batch-sizes 1,2,4 [--tp-sizes 1,2] [--vocab-size 32000] \\
        [--optimizer] [--comm-ranks 2] [--threads 1] --output PROFILE.json

How each part is measured: ``megatron_het/profiling/`` (layers: megatron-core ``TransformerLayer``s
of the local spec, world size 1, or ``tp`` processes for ``--tp-sizes`` > 1; parts; optimizer;
links), format: ``megatron_het/perf/profile.py``, how the model uses it: docs/performance-model.md.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

from megatron_het.cli.output import check_output_file
from megatron_het.cluster import CATALOG, ModelSpec
from megatron_het.cluster.errors import suggest
from megatron_het.errors import UserError
from megatron_het.perf.flops import padded_vocab_size
from megatron_het.perf.profile import save_profile
from megatron_het.profiling.layers import profile_concurrent, profile_ep_layers, profile_layers, profile_tp_layers

MAX_MEASURED_SIZE = 4096  # micro-batch or TP size: beyond it one measurement would not fit any host


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4 (got {text!r})") from None
    sizes = list(dict.fromkeys(sizes))  # once each: a repeated size would write duplicate entries
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,2,4 (got {text!r})")
    if max(sizes) > MAX_MEASURED_SIZE:
        raise argparse.ArgumentTypeError(f"{max(sizes)} exceeds the bound {MAX_MEASURED_SIZE} (one measurement of "
                                         f"that size would not fit in memory); pass sizes like 1,2,4")
    return sizes


def _moe_fields(args: argparse.Namespace, ap: argparse.ArgumentParser) -> dict[str, object]:
    """ModelSpec's MoE fields from the flags (none without --num-experts; MoE flags alone are refused)."""
    if args.num_experts is None:
        given = [f for f, v, default in (("--moe-ffn-hidden-size", args.moe_ffn_hidden_size, None),
                                         ("--moe-shared-expert-intermediate-size",
                                          args.moe_shared_expert_intermediate_size, None),
                                         ("--moe-router-topk", args.moe_router_topk, 2),
                                         ("--moe-token-dispatcher-type", args.moe_token_dispatcher_type, "allgather"),
                                         ("--moe-aux-loss-coeff", args.moe_aux_loss_coeff, 0.0)) if v != default]
        if given:
            ap.error(f"{given[0]} describes an MoE layer: pass --num-experts too")
        return {}
    return dict(num_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                moe_ffn_hidden_size=args.moe_ffn_hidden_size, moe_token_dispatcher_type=args.moe_token_dispatcher_type,
                moe_aux_loss_coeff=args.moe_aux_loss_coeff,
                moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-layers", type=int, default=1, help="layers to stack (times are per layer)")
    ap.add_argument("--hidden-size", type=int, required=True)
    ap.add_argument("--num-attention-heads", type=int, required=True)
    ap.add_argument("--num-query-groups", type=int, default=None)
    ap.add_argument("--ffn-hidden-size", type=int, default=None)
    ap.add_argument("--seq-length", type=int, required=True)
    ap.add_argument("--swiglu", action="store_true")
    ap.add_argument("--disable-bias-linear", action="store_true", help="linear layers without biases (as Llama, Mixtral)")
    ap.add_argument("--hidden-dropout", type=float, default=0.0,
                    help="the run's hidden dropout (Megatron-LM's default is 0.1; drawing masks costs CPU time)")
    ap.add_argument("--attention-dropout", type=float, default=0.0, help="the run's attention dropout (likewise)")
    ap.add_argument("--num-experts", type=int, default=None,
                    help="profile megatron-core's MoE layer with this many experts (all on this process: expert "
                         "parallelism 1; the model adds the all-to-all of a plan's EP); default: a dense layer")
    ap.add_argument("--moe-router-topk", type=int, default=2, help="experts each token runs (with --num-experts)")
    ap.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                    help="each expert's MLP width (with --num-experts; default: --ffn-hidden-size)")
    ap.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                    help="a shared expert's width (with --num-experts; default: none)")
    ap.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall"), default="allgather",
                    help="the MoE dispatcher the run uses (with --num-experts; Megatron's default: allgather)")
    ap.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                    help="the run's load-balancing loss coefficient (with --num-experts): > 0 times its computation")
    ap.add_argument("--micro-batch-sizes", type=_sizes, default=[1, 2, 4])
    ap.add_argument("--tp-sizes", type=_sizes, default=[1],
                    help="tensor-parallel sizes to measure; > 1 runs the layers on that many local gloo processes "
                         "and the times include their TP collectives")
    ap.add_argument("--ep-sizes", type=_sizes, default=[],
                    help="MoE: also measure the layer with its experts over this many local gloo processes (expert-TP "
                         "1), at tp 1 and every --tp-sizes (max(tp, ep) processes); the times include the "
                         "dispatcher's all-to-all on this host")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--device", default="CPU", help="catalog device type name recorded in the profile")
    ap.add_argument("--implementation", choices=("auto", "megatron", "torch"), default="auto",
                    help="auto: megatron-core, falling back to the torch reference layer")
    ap.add_argument("--concurrent", type=int, default=1,
                    help="measure tp=1 parts on this many local processes at once (one thread each), as that many "
                         "ranks sharing this host see them when all compute; 1: this process alone")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: time thread CPU time, the clock an emulated run on shared cores stretches "
                         "(EmulationTimer clock=time.thread_time); wall counts other processes' turns too")
    ap.add_argument("--sweep-mib", type=int, default=0,
                    help="sweep this many MiB through the caches before each timed repetition, as the other ranks "
                         "sharing the cores do between two of a rank's actions (0: warm, back-to-back)")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="also measure the embedding and the output layer + loss for this vocabulary (padded "
                         "like Megatron to a multiple of 128)")
    ap.add_argument("--optimizer", action="store_true", help="also measure the AdamW step per parameter")
    ap.add_argument("--split-backward", action="store_true",
                    help="also time the zero-bubble B/W split of the layers against their fused backward (what "
                         "the model prices ZB-H1's B and W from; without it, half the backward each)")
    ap.add_argument("--call-overhead", action="store_true",
                    help="also measure the fixed cost of one call of a layer stack (a model chunk's forward/backward, "
                         "one pipeline action) beyond its layers: the intercept of time vs layers, from 1 layer and "
                         "--num-layers (>= 2); the model charges it once per action")
    ap.add_argument("--comm-ranks", type=int, default=0,
                    help="also measure all-reduce and send/recv among this many local gloo processes and fit "
                         "the latency/bandwidth the model uses for links of this host (0: skip)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's); match what each training rank uses, e.g. 1 "
                         "when one process per core stands in for a GPU (megatron_het.platform.local_launch)")
    ap.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    for flag, value, least in (("--threads", args.threads, 1), ("--warmup", args.warmup, 0),
                               ("--repeats", args.repeats, 1), ("--concurrent", args.concurrent, 1),
                               ("--vocab-size", args.vocab_size, 1), ("--sweep-mib", args.sweep_mib, 0)):
        if value is not None and value < least:
            ap.error(f"{flag} must be >= {least}, got {value}")
    if args.call_overhead and args.num_layers < 2:
        ap.error(f"--call-overhead needs --num-layers >= 2 (an intercept of time vs layers), got {args.num_layers}")
    if args.comm_ranks == 1 or args.comm_ranks < 0:
        ap.error(f"--comm-ranks must be 0 (skip) or >= 2, got {args.comm_ranks}")
    try:  # everything checkable is checked before minutes of measuring
        check_output_file(args.output, flag="--output")
        if args.device not in CATALOG:  # a typo would be recorded and the profile never matched by plan/predict
            raise UserError("not a catalog device type (plan.py and predict.py match profiles to the cluster's "
                            "devices by this name)", field="--device", value=args.device,
                            fix=suggest(args.device, CATALOG, what="device types (tools/cluster.py catalog)"))
        model = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                          num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                          ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length, vocab_size=1,
                          swiglu=args.swiglu, add_bias_linear=not args.disable_bias_linear,
                          hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                          **_moe_fields(args, ap))
        vocab = None if args.vocab_size is None else padded_vocab_size(args.vocab_size)
        if args.ep_sizes and not model.is_moe:
            raise UserError("spreads an MoE layer's experts over that many processes", field="--ep-sizes",
                            value=",".join(map(str, args.ep_sizes)), fix="pass --num-experts too")
        for ep in args.ep_sizes:
            if ep < 2 or model.num_experts % ep:
                raise UserError(f"must be >= 2 and divide --num-experts {model.num_experts}", field="--ep-sizes",
                                value=ep, fix="pass EP sizes dividing the experts, e.g. 2")
            for tp in {1, *args.tp_sizes}:
                if max(ep, tp) % min(ep, tp):
                    raise UserError(f"EP {ep} beside TP {tp}: the layer runs on max(tp, ep) processes, so one must "
                                    "divide the other", field="--ep-sizes", value=ep,
                                    fix="pass EP and TP sizes that divide one another")
        if model.is_moe and model.add_bias_linear:  # megatron-core's experts add their bias in place at EP 1
            raise UserError("an MoE layer with linear biases trains only with expert parallelism > 1 and expert-TP "
                            "1 (plan/checks.py), and the profile runs its experts at EP 1", field="--num-experts",
                            value=args.num_experts, fix="pass --disable-bias-linear (as Mixtral)")
    except UserError as err:  # bugs are not caught: they surface as tracebacks
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    options = dict(num_layers=args.num_layers, micro_batch_sizes=args.micro_batch_sizes, device=args.device,
                   warmup=args.warmup, repeats=args.repeats, dtype=getattr(torch, args.dtype),
                   implementation=args.implementation, vocab_size=vocab, optimizer=args.optimizer,
                   clock=args.clock, sweep_mib=args.sweep_mib, split_backward=args.split_backward,
                   call_overhead=args.call_overhead)
    profile = (profile_layers(model, **options) if args.concurrent == 1 else
               profile_concurrent(model, processes=args.concurrent, **options))
    tp_entries = tuple(e for tp in args.tp_sizes if tp > 1 for e in profile_tp_layers(
        model, tp=tp, num_layers=args.num_layers, micro_batch_sizes=args.micro_batch_sizes, device=args.device,
        warmup=args.warmup, repeats=args.repeats, dtype=getattr(torch, args.dtype)))
    ep_entries = tuple(e for tp in sorted({1, *args.tp_sizes}) for ep in args.ep_sizes if ep > 1 for e in profile_ep_layers(
        model, ep=ep, tp=tp, num_layers=args.num_layers, micro_batch_sizes=args.micro_batch_sizes,
        device=args.device, warmup=args.warmup, repeats=args.repeats, dtype=getattr(torch, args.dtype)))
    how = "" if 1 in args.tp_sizes else "; its tp=1 layer entries left out (--tp-sizes without 1)"
    if tp_entries:
        how += (f"; tp={','.join(str(t) for t in args.tp_sizes if t > 1)} entries: the layers split over that many "
                f"local gloo processes{' (sequence parallel)' if model.is_moe else ''}, their collectives in the times")
    if ep_entries:
        how += (f"; ep={','.join(str(e) for e in args.ep_sizes)} entries: the experts spread over that many local "
                "gloo processes (expert-TP 1), each routing tokens of its own, the dispatcher's traffic and waits in "
                "the times")
    if 1 not in args.tp_sizes:
        profile = replace(profile, entries=())
    profile = replace(profile, entries=profile.entries + tp_entries + ep_entries, method=profile.method + how)
    if args.comm_ranks:
        from megatron_het.profiling.links import measure_link

        profile = replace(profile, link=measure_link(args.comm_ranks))
    save_profile(profile, args.output)
    print(f"wrote {args.output}: {profile.method}")
    for e in profile.entries:
        print(f"  tp={e.tp}{f' ep={e.ep}' if e.ep > 1 else ''} micro_batch_size={e.micro_batch_size}: forward {e.forward_s * 1e3:.3f} ms, "
              f"backward {e.backward_s * 1e3:.3f} ms, peak {e.peak_memory_bytes / 2**20:.1f} MiB per layer")
    for p in profile.parts:
        print(f"  {p.part} (vocab {p.vocab_size}), micro_batch_size={p.micro_batch_size}: forward "
              f"{p.forward_s * 1e3:.3f} ms, backward {p.backward_s * 1e3:.3f} ms")
    if profile.optimizer_s_per_parameter is not None:
        print(f"  AdamW step: {profile.optimizer_s_per_parameter * 1e9:.2f} ns per parameter")
    if profile.call_overhead is not None:
        print(f"  per call of a layer stack: forward {profile.call_overhead[0] * 1e3:+.3f} ms, backward "
              f"{profile.call_overhead[1] * 1e3:+.3f} ms (intercept of time vs layers)")
    if profile.link is not None:
        print(f"  links of this host ({profile.link.ranks} processes): latency {profile.link.latency_us:.1f} us, "
              f"bandwidth {profile.link.bandwidth_gbps:.2f} Gbit/s")
    return 0
