"""What pretrain_gpt.py does with each Megatron-LM flag: honours it, announces it as ignored, or
refuses it by name. No flag is dropped silently.

- honoured: read by ``runtime/arguments.py`` (its ``FLAGS`` table names every one);
- ``IGNORED``: flags with no meaning here (performance-only kernels megatron-core picks for the
  platform, infrastructure this runtime does differently). A value other than Megatron's default
  gets one start-up line with the reason;
- ``BUILT``: model flags whose value the model this runtime builds fixes. Given with another value:
  refused. Not given, and Megatron's default differs from what is built: one start-up line saying
  what is built instead;
- everything else: refused when its value differs from Megatron's default, one line per flag with
  the fix (``REFUSED_FIX`` where we know a better one than "drop it").

Pure: takes the parsed namespace, returns lines or raises ``ValueError``; no torch import.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

PERF = "performance-only; megatron-core chooses its kernels for the platform"

# dest -> why it has no meaning here
IGNORED: dict[str, str] = {
    **{d: PERF for d in (
        "masked_softmax_fusion", "bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion",
        "apply_rope_fusion", "gradient_accumulation_fusion", "no_persist_layer_norm", "cross_entropy_loss_fusion",
        "cross_entropy_fusion_impl", "gradient_reduce_div_fusion", "attention_softmax_in_fp32",
        "empty_unused_memory_level", "manual_gc", "manual_gc_interval", "manual_gc_eval")},
    "use_flash_attn": "the attention kernel is the plan's (Plan.attention; tools/plan.py --attention), priced by "
                      "the planner",
    "deprecated_use_mcore_models": "always megatron-core models (deprecated in Megatron-LM too)",
    "distributed_backend": "backends come from the cluster file: NCCL/RCCL inside GPU islands, gloo on hosts, a "
                           "host-staged bridge between vendors",
    "local_rank": "torchrun's LOCAL_RANK (or MEGATRON_HET_LOCAL_RANK) picks the device",
    "use_cpu_initialization": "weights are always drawn on the host from the seed, the same under every plan "
                              "(runtime/initial_values.py)",
    "num_workers": "batches are read in the training process (the data is memory-mapped)",
    "mmap_bin_files": "indexed datasets are always memory-mapped",
    "timing_log_level": "the end-of-run summary gathers every rank's time split",
    "timing_log_option": "the end-of-run summary gathers every rank's time split",
    "barrier_with_L1_time": "the end-of-run summary gathers every rank's time split",
    "log_validation_ppl_to_tensorboard": "validation loss is logged; perplexity is exp(loss)",
    "enable_one_logger": "NVIDIA's one-logger telemetry is not used",
    "one_logger_project": "NVIDIA's one-logger telemetry is not used",
    "one_logger_run_name": "NVIDIA's one-logger telemetry is not used",
    "one_logger_async": "NVIDIA's one-logger telemetry is not used",
    "check_for_nan_in_loss_and_grad": "a non-finite loss or gradient norm always stops the run",
    "create_attention_mask_in_dataloader": "the causal mask is megatron-core's, built in the attention",
    "exit_on_missing_checkpoint": "--load of a directory without a checkpoint starts from scratch and says so",
    "dataloader_type": "batches follow Megatron's single (resumable) sampler order",
    "attention_backend": "the attention kernel is the plan's (Plan.attention; tools/plan.py --attention), priced by "
                         "the planner",
    "add_position_embedding": "deprecated in Megatron-LM too: positions are --position-embedding-type's (without "
                              "rope Megatron-LM and this runtime refuse it)",
    **{d: "checkpoints are megatron-het's resharding format, written synchronously and atomically by every rank "
          "for its own shards (tools/checkpoint/convert.py writes Megatron-LM's torch_dist)" for d in (
        "ckpt_format", "async_save", "use_persistent_ckpt_worker", "ckpt_fully_parallel_save",
        "ckpt_fully_parallel_load", "ckpt_assume_constant_structure")},
    "dist_ckpt_optim_fully_reshardable": "optimizer state always reshards between any two plans "
                                         "(checkpoint/ and sharding/)",
    "dist_ckpt_strictness": "loading is always strict: a missing, unexpected or misshapen tensor is an error naming it",
    "use_checkpoint_opt_param_scheduler": "the learning rate is recomputed from the flags at every iteration "
                                          "(Megatron-LM's --override-opt_param-scheduler): resume with the saved "
                                          "run's schedule flags",
    "test_mode": "Megatron-LM's own CI switch",
    "calculate_per_token_loss": "every token counts here (no --eod-mask-loss), so the loss is already the mean over "
                                "the global batch's tokens: the same loss and gradients",
    "no_load_rng": "RNG states are not in megatron-het's checkpoints: a resumed run re-seeds from --seed (dropout "
                   "masks after a resume differ from an uninterrupted run's)",
    "grad_reduce_in_bf16": "gradients are always reduced in fp32 (twice the bytes, no rounding)",
    "overlap_param_gather_with_optimizer_step": PERF + " (--overlap-param-gather overlaps the next forward)",
    "moe_grouped_gemm": "experts run as megatron-core's SequentialMLP, one GEMM pair per expert (the same math and "
                        "checkpoint names on every platform; grouped GEMM is a kernel choice)",
    **{d: PERF for d in ("moe_permute_fusion", "moe_router_fusion")},
}

# model flags: dest -> the value this runtime builds for a ModelSpec (model/gpt.py)
BUILT: dict[str, Callable[[object], object]] = {
    "openai_gelu": lambda m: False,
    "make_vocab_size_divisible_by": lambda m: 128,
}
WHY_BUILT = ("this runtime builds megatron-core's exact GeLU and pads the vocabulary to a multiple of 128 x TP "
             "(checkpoints and conversions assume both)")

# dest -> the fix a refusal names, where there is a better one than "drop it"
REFUSED_FIX: dict[str, str] = {
    "context_parallel_size": "context parallelism lands with #38; drop it or shorten --seq-length",
}


def _differs(value: object, default: object) -> bool:
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(default, list):
        default = tuple(default)
    return value != default


def review_flags(ns: argparse.Namespace, *, defaults: dict[str, object], given: Iterable[str],
                 honoured: Iterable[str], model, spell: Callable[[str], str]) -> list[str]:
    """Start-up lines for every announced flag; raises ValueError naming every refused one (one line
    each, with its fix). ``defaults``: Megatron's default per destination; ``given``: destinations
    written on the command line; ``honoured``: destinations runtime/arguments.py reads; ``model``:
    the ModelSpec being built; ``spell``: a destination's flag spelling."""
    given, honoured = frozenset(given), frozenset(honoured)
    lines: list[str] = []
    refused: list[str] = []
    for dest, default in sorted(defaults.items()):
        if dest in honoured:
            continue
        value = getattr(ns, dest)
        flag = spell(dest)
        if dest in BUILT:
            built = BUILT[dest](model)
            if not _differs(value, built):
                continue
            if dest in given:
                fix = f"drop {flag}" + ("" if isinstance(built, bool) else f", or pass {built}")  # a switch: drop it
                refused.append(f"{flag} {value}: {WHY_BUILT}; this model is built with {built}. Fix: {fix}")
            else:
                lines.append(f"note: {flag}: Megatron-LM's default {value} is not what is built: {built} ({WHY_BUILT})")
        elif not _differs(value, default):
            continue
        elif dest in IGNORED:
            lines.append(f"note: {flag} {value} is ignored: {IGNORED[dest]}")
        else:
            fix = REFUSED_FIX.get(dest, f"drop {flag} (Megatron-LM's default is {default!r})")
            refused.append(f"{flag} {value}: not supported by megatron-het. Fix: {fix}")
    if refused:
        raise ValueError("\n".join(refused))
    return lines
