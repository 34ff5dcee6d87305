"""Command-line arguments of pretrain_gpt.py: Megatron-LM's own parser plus --hetero-*.

The parser is Megatron-LM's (``runtime/megatron_parser.py``): every Megatron flag with Megatron's
default. ``FLAGS`` names each flag this runtime reads and the config field it fills (a flag Megatron
does not have is added here, its default that field's default in ``train/config.py``); every other
Megatron flag is announced as ignored or refused by name (``runtime/flag_policy.py``).
``parse_args`` builds the typed objects; no argparse Namespace leaves this module. Bad values exit
with argparse's message naming the flag (code 2), before any rendezvous; a tokenizer file that does
not load is a one-line ConfigError naming --tokenizer-model and the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_het.cluster import ClusterSpec, ConfigError, ModelSpec, load_cluster, load_model
from megatron_het.errors import UserError
from megatron_het.runtime.resilience_options import FaultInjection, ResilienceOptions, parse_store
from megatron_het.train.config import DataConfig, LoopConfig, TensorBoardConfig, TrainConfig

if TYPE_CHECKING:
    from megatron_het.plan.megatron_layout import LayoutFlags


@dataclass(frozen=True)
class Flag:
    """One command-line flag: its name, the ``section.field`` it fills, its type (bool: a switch), help."""

    name: str
    to: str  # section: model (overrides of --hetero-model), train, data, loop, tensorboard, run (PretrainArgs)
    type: type = str
    help: str = ""
    required: bool = False


# (defaults are the config fields' own; model flags default to None: the model file decides)
FLAGS = (
    Flag("--hetero-model", "run.model_file", help="model file (MODEL.yaml); the model flags override its fields"),
    *(Flag(f"--{f.replace('_', '-')}", f"model.{f}", int) for f in (
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "seq_length",
        "max_position_embeddings")),
    Flag("--vocab-size", "model.vocab_size", int, "unpadded vocabulary (default: the tokenizer's)"),
    Flag("--kv-channels", "model.kv_channels", int),
    Flag("--init-method-std", "model.init_method_std", float),
    Flag("--rotary-base", "model.rotary_base", int),
    Flag("--rotary-percent", "model.rotary_percent", float),
    Flag("--rotary-interleaved", "model.rotary_interleaved", bool),
    Flag("--norm-epsilon", "model.layernorm_epsilon", float),
    Flag("--swiglu", "model.swiglu", bool),
    # architecture (ModelSpec's fields of the same meaning); without a model file Megatron's defaults
    # apply (``ARCHITECTURE``), with one the file's recipe does
    Flag("--normalization", "model.normalization"),
    Flag("--position-embedding-type", "model.position_embedding_type"),
    Flag("--disable-bias-linear", "model.add_bias_linear", bool),
    Flag("--add-qkv-bias", "model.add_qkv_bias", bool),
    Flag("--qk-layernorm", "model.qk_layernorm", bool),
    Flag("--apply-layernorm-1p", "model.layernorm_zero_centered_gamma", bool),
    Flag("--squared-relu", "model.squared_relu", bool),
    Flag("--hidden-dropout", "model.hidden_dropout", float),
    Flag("--attention-dropout", "model.attention_dropout", float),
    # mixture of experts (ModelSpec's fields of the same names; cluster/model_moe.py checks them)
    Flag("--num-experts", "model.num_experts", int),
    *(Flag(f"--{f.replace('_', '-')}", f"model.{f}", int) for f in (
        "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq", "moe_shared_expert_intermediate_size")),
    *(Flag(f"--{f.replace('_', '-')}", f"model.{f}", float) for f in (
        "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_capacity_factor", "moe_router_topk_scaling_factor")),
    *(Flag(f"--{f.replace('_', '-')}", f"model.{f}") for f in (
        "moe_router_load_balancing_type", "moe_token_dispatcher_type", "moe_token_drop_policy",
        "moe_router_score_function")),
    Flag("--moe-pad-expert-input-to-capacity", "model.moe_pad_expert_input_to_capacity", bool),
    Flag("--moe-router-pre-softmax", "model.moe_router_pre_softmax", bool),
    Flag("--group-query-attention", "run.group_query_attention", bool),  # --num-query-groups counts only with it
    # Megatron's layout flags: without --hetero-plan they build the plan (plan/megatron_layout.py); with
    # one, TP/PP must be its layout and the others are refused (the plan decides them)
    *(Flag(f"--{f.replace('_', '-')}", f"run.{f}", int) for f in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
        "num_virtual_stages_per_pipeline_rank", "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers", "recompute_num_layers")),
    Flag("--recompute-granularity", "run.recompute_granularity"),
    Flag("--recompute-method", "run.recompute_method"),
    Flag("--untie-embeddings-and-output-weights", "model.untie_embeddings_and_output_weights", bool),
    Flag("--micro-batch-size", "train.micro_batch_size", int),  # not given: the plan's (``_batch_from_plan``)
    Flag("--global-batch-size", "train.global_batch_size", int),
    Flag("--train-iters", "train.train_iters", int),  # or --train-samples
    *(Flag(f"--{f.replace('_', '-')}", f"train.{f}", float) for f in (
        "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad")),
    Flag("--lr-decay-style", "train.lr_decay_style"),
    Flag("--decoupled-lr", "train.decoupled_lr", float),
    Flag("--decoupled-min-lr", "train.decoupled_min_lr", float),
    *(Flag(f"--{f.replace('_', '-')}", f"train.{f}", int) for f in (
        "lr_decay_iters", "lr_wsd_decay_iters", "train_samples", "lr_decay_samples", "lr_warmup_samples",
        "lr_wsd_decay_samples")),
    *(Flag(f"--{f.replace('_', '-')}", f"train.{f}", float) for f in ("lr_warmup_fraction", "lr_warmup_init")),
    Flag("--lr-wsd-decay-style", "train.lr_wsd_decay_style"),
    *(Flag(f"--{f.replace('_', '-')}", f"train.{f}", int) for f in ("lr_warmup_iters", "seed", "log_interval")),
    Flag("--log-params-norm", "train.log_params_norm", bool),
    Flag("--log-num-zeros-in-grad", "train.log_num_zeros_in_grad", bool),
    Flag("--deterministic-mode", "train.deterministic_mode", bool, "bit-reproducible kernels and collectives "
         "(NCCL_ALGO=Ring, CUBLAS_WORKSPACE_CONFIG, torch.use_deterministic_algorithms)"),
    Flag("--bf16", "train.bf16", bool, "bf16 parameters and activations, fp32 main parameters and gradients"),
    Flag("--fp16", "train.fp16", bool, "fp16 parameters and activations with loss scaling, fp32 main parameters"),
    Flag("--loss-scale", "train.loss_scale", float, "constant fp16 loss scale (default: dynamic)"),
    Flag("--initial-loss-scale", "train.initial_loss_scale", float, "first dynamic loss scale"),
    Flag("--min-loss-scale", "train.min_loss_scale", float, "floor of the dynamic loss scale"),
    Flag("--loss-scale-window", "train.loss_scale_window", int, "clean steps before the scale doubles"),
    Flag("--hysteresis", "train.hysteresis", int, "overflows tolerated before the scale halves"),
    Flag("--accumulate-allreduce-grads-in-fp32", "train.accumulate_allreduce_grads_in_fp32", bool,
         "gradients accumulated and reduced in fp32 (always so in this runtime)"),
    Flag("--transformer-impl", "train.transformer_impl", help="transformer_engine or local layer spec (default: "
         "transformer_engine where importable on a GPU, else local)"),
    Flag("--distributed-timeout-minutes", "train.distributed_timeout_minutes", int,
         "timeout of the process groups: a hung peer fails a collective after this long"),
    Flag("--data-path", "data.data_path", tuple, "indexed dataset prefix (or weight prefix ... pairs)"),
    *(Flag(f"--{f.replace('_', '-')}", f"data.{f}") for f in ("split", "data_cache_path", "tokenizer_type",
                                                                "tokenizer_model", "vocab_file", "merge_file")),
    Flag("--mock-data", "data.mock_data", bool, "synthetic tokens instead of --data-path"),
    Flag("--save", "loop.save"),
    Flag("--load", "loop.load"),
    Flag("--finetune", "loop.finetune", bool),
    Flag("--no-load-optim", "loop.no_load_optim", bool),
    *(Flag(f"--{f.replace('_', '-')}", f"loop.{f}", int) for f in ("save_interval", "eval_interval", "eval_iters",
                                                                      "save_retain_interval")),
    Flag("--profile", "loop.profile", bool),
    Flag("--use-pytorch-profiler", "loop.use_pytorch_profiler", bool),
    *(Flag(f"--{f.replace('_', '-')}", f"loop.{f}", int) for f in ("profile_step_start", "profile_step_end")),
    Flag("--profile-ranks", "loop.profile_ranks", tuple),
    Flag("--pytorch-profiler-collect-shapes", "loop.pytorch_profiler_collect_shapes", bool),
    Flag("--pytorch-profiler-collect-callstack", "loop.pytorch_profiler_collect_callstack", bool),
    Flag("--exit-interval", "loop.exit_interval", int),
    Flag("--exit-duration-in-mins", "loop.exit_duration_in_mins", float),
    Flag("--check-weight-hash-across-dp-replicas-interval", "loop.check_weight_hash_interval", int,
         "iterations between checks that every holder of each parameter (replicas of any layout, TP peers, tied "
         "copies) holds the same value; also before the first step (default: never)"),
    Flag("--tensorboard-dir", "tensorboard.log_dir", help="write TensorBoard event files here (rank 0 writes)"),
    Flag("--tensorboard-log-interval", "tensorboard.log_interval", int, "iterations between TensorBoard points"),
    Flag("--tensorboard-queue-size", "tensorboard.queue_size", int, "events buffered before a write to disk"),
    Flag("--log-timers-to-tensorboard", "tensorboard.log_timers", bool, "iteration time, per-stage compute/idle"),
    Flag("--log-memory-to-tensorboard", "tensorboard.log_memory", bool, "peak and current memory (CPU: RSS)"),
    Flag("--log-throughput", "tensorboard.log_throughput", bool, "tokens/s and samples/s to TensorBoard"),
    *(Flag(f"--{f.replace('_', '-')}", f"tensorboard.{f}") for f in (
        "wandb_project", "wandb_exp_name", "wandb_save_dir", "wandb_entity")),
    Flag("--sequence-parallel", "run.sequence_parallel", bool, "turn on the plan's sequence_parallel"),
    Flag("--tp-comm-overlap", "run.tp_comm_overlap", bool, "chunked TP collective/GEMM overlap on every stage with "
         "TP > 1 (plans can also choose per stage); needs sequence parallelism"),
    Flag("--hetero-tp-comm-overlap-chunks", "train.tp_comm_overlap_chunks", int, "pieces per overlapped GEMM"),
    Flag("--overlap-grad-reduce", "train.overlap_grad_reduce", bool, "reduce gradient buckets during the backward"),
    Flag("--ddp-bucket-size", "train.ddp_bucket_size", int, "parameters per gradient bucket (default: "
         "megatron-core's max(40M, 1M x replicas))"),
    Flag("--expert-model-parallel-size", "run.expert_model_parallel_size", int, "MoE: spread the experts over this "
         "many ranks (the plan's expert_parallel; docs/moe.md)"),
    Flag("--expert-tensor-parallel-size", "run.expert_tensor_parallel_size", int, "MoE: split each expert's weights "
         "over this many ranks (default: each stage's TP size)"),
    Flag("--use-distributed-optimizer", "run.use_distributed_optimizer", bool, "shard fp32 main parameters and "
         "Adam moments over every holder of each parameter (the plan records it)"),
    Flag("--overlap-param-gather", "train.overlap_param_gather", bool, "with the distributed optimizer: all-gather "
         "the updated parameters while the next forward runs"),
    Flag("--hetero-cluster", "run.cluster_file", help="CLUSTER.yaml", required=True),
    Flag("--hetero-plan", "run.plan_source", help="a plan file (tools/plan.py writes one) or 'auto' to run the "
         "planner at start-up; without it: the layout of --tensor/--pipeline-model-parallel-size over the cluster's "
         "islands when given, else the planner"),
    Flag("--hetero-profile", "run.profile", tuple,
         "measured profiles (PROFILE.json ...) for --hetero-plan auto: one per device type, or one per island"),
    Flag("--no-emulation", "run.no_emulation", bool, "ignore the cluster file's emulation block"),
    Flag("--hetero-device-stand-in", "run.device_stand_in", bool, "let a process run an island of another vendor "
         "than its device's: CPUs for NVIDIA/AMD islands (tests, demos), one vendor's GPUs for the other's (bridge "
         "tests); without it (or an emulation: block) that is an error naming the rank and island"),
    Flag("--hetero-resilience", "run.resilience", bool, "survive rank failures in-process: re-route a failed "
         "rank's work to its data-parallel peers or re-plan over the survivors (off by default)"),
    Flag("--hetero-resilience-store", "run.resilience_store", help="HOST:PORT of the resilience store, a process "
         "outside the ranks (python -m megatron_het.cli.resilience_store; the launchers start it)"),
    Flag("--hetero-heartbeat-interval", "run.heartbeat_interval", float, "seconds between heartbeats (default 0.5)"),
    Flag("--hetero-failure-timeout", "run.failure_timeout", float, "seconds after which a silent or stuck peer "
         "counts as failed (default 15)"),
    Flag("--hetero-resilience-policy", "run.resilience_policy", help="auto (the simulator picks), reroute or replan "
         "(replan writes to --save)"),
    Flag("--hetero-resilience-report", "run.resilience_report", help="directory: each rank writes rank{R}.json "
         "(failures survived, samples read per iteration)"),
    Flag("--hetero-inject-fault", "run.inject_fault", help="testing: RANK:ITERATION[:ACTIONS] SIGKILLs that rank"),
    Flag("--hetero-staggered-step", "run.staggered_step", bool, "each pipeline stage steps its optimizer right after "
         "its own gradient reduction (ReCycle); needs --clip-grad 0"),
)
CONFIGS = {"train": TrainConfig, "data": DataConfig, "loop": LoopConfig, "tensorboard": TensorBoardConfig}


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM's parser with the flags of ``FLAGS`` it lacks (the --hetero-* ones) added."""
    from megatron_het.runtime.megatron_parser import megatron_parser

    p = megatron_parser(prog="pretrain_gpt.py", description="Train a GPT with megatron-core on a heterogeneous "
                        "cluster (launch with torchrun). Megatron-LM's flags, plus:")
    # argparse prints the usage before each error; 800 flags would bury the one line that matters
    p.usage = "%(prog)s --hetero-cluster CLUSTER.yaml [--hetero-plan PLAN.json|auto] [Megatron-LM flags] (-h: all)"
    group = p.add_argument_group("megatron-het")
    for flag in FLAGS:
        if flag.name in p._option_string_actions:  # Megatron's definition and default
            continue
        section, field = flag.to.split(".")
        fields = {f.name: f.default for f in dataclasses.fields(CONFIGS[section])} if section in CONFIGS else {}
        default = None if fields.get(field, dataclasses.MISSING) is dataclasses.MISSING else fields[field]
        kw: dict = {"dest": flag.to, "help": flag.help or None, "required": flag.required}
        if flag.type is bool:
            kw.update(action="store_true", default=default)
        else:
            kw.update(default=default, type=str if flag.type is tuple else flag.type, metavar=field.upper(),
                      nargs="+" if flag.type is tuple else None)
        group.add_argument(flag.name, **kw)
    return p


@dataclass(frozen=True, kw_only=True)
class PretrainArgs:
    """Everything a run needs, validated."""

    model: ModelSpec
    train: TrainConfig
    data: DataConfig
    loop: LoopConfig
    cluster: ClusterSpec
    plan_source: str | None  # a path or "auto"; None: no --hetero-plan (``layout``, or the planner)
    profile: tuple[str, ...] | None  # measured profiles for plan_source "auto"
    no_emulation: bool  # run every island at host speed despite the cluster's emulation block
    sequence_parallel: bool  # turn on the plan's sequence parallelism
    tp_comm_overlap: bool  # overlap TP communication on every stage with TP > 1
    tensorboard: TensorBoardConfig | None  # None: no --tensorboard-dir
    use_distributed_optimizer: bool = False  # turn on the plan's distributed optimizer (runtime/plan_record.py)
    # MoE: the plan's expert_parallel / expert_tensor_parallel (plan/experts.py); 1 / None: the plan's own
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    resilience: ResilienceOptions | None = None  # None: no --hetero-resilience
    device_stand_in: bool = False  # ranks may run islands of another vendor (runtime/device_check.py)
    staggered_step: bool = False  # --hetero-staggered-step
    # Megatron's --tensor/--pipeline-model-parallel-size when given (None: the plan decides); the plan
    # must have that layout (cli/pretrain.py checks)
    tensor_model_parallel_size: int | None = None
    pipeline_model_parallel_size: int | None = None
    # Megatron's layout flags without --hetero-plan: the plan they describe is built at start-up
    layout: LayoutFlags | None = None
    notes: tuple[str, ...] = ()  # start-up lines: Megatron flags announced as ignored, defaults taken


def _sections(ns: argparse.Namespace, parser: argparse.ArgumentParser,
              given: frozenset[str]) -> dict[str, dict[str, object]]:
    """The parsed values grouped by section (the one mapping of every flag). Model flags not on the
    command line are None: the model file (--hetero-model) decides them."""
    out: dict[str, dict[str, object]] = {}
    for flag in FLAGS:
        section, field = flag.to.split(".")
        dest = parser._option_string_actions[flag.name].dest
        value = getattr(ns, dest) if section != "model" or dest in given else None
        if section == "run" and field in LAYOUT_FIELDS:
            value = value if dest in given else None  # not given: the plan decides
        if section == "model" and isinstance(value, list):
            if field == "moe_layer_freq":  # Megatron's moe_freq_type: a pattern string becomes a list
                raise ConfigError("a per-layer pattern is not supported yet", field=flag.name, value=value,
                                  fix="pass an integer N (every N-th layer from layer 0 has experts)")
            # Megatron-LM takes several load-balancing types (and coefficients) at once; one is its
            # usual form, which arguments.py unwraps as here
            if len(value) != 1:
                raise ConfigError("one value is supported (several load-balancing losses at once are not built)",
                                  field=flag.name, value=value, fix=f"pass one value to {flag.name}")
            value = value[0]
        out.setdefault(section, {})[field] = tuple(value or ()) if flag.type is tuple else value
    return out


LAYOUT_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                 "num_virtual_stages_per_pipeline_rank", "decoder_first_pipeline_num_layers",
                 "decoder_last_pipeline_num_layers", "recompute_granularity", "recompute_method",
                 "recompute_num_layers")


def layout_from_args(run: dict[str, object], num_layers: int) -> tuple[LayoutFlags | None, list[str]]:
    """Megatron's layout flags as a LayoutFlags (None when none is given) and start-up notes;
    ValueError naming a flag this runtime cannot honour."""
    from megatron_het.plan.megatron_layout import LayoutFlags

    given = {f: run[f] for f in LAYOUT_FIELDS if run[f] is not None}
    if not given:
        return None, []
    if run["plan_source"] is not None:
        extra = sorted(set(given) - {"tensor_model_parallel_size", "pipeline_model_parallel_size"})
        if extra:
            flag = "--" + extra[0].replace("_", "-")
            raise ValueError(f"{flag} {given[extra[0]]}: --hetero-plan {run['plan_source']} decides the layout. "
                             f"Fix: drop {flag}, or drop --hetero-plan to build the layout from Megatron's flags")
        return None, []
    notes: list[str] = []
    tp, pp = given.get("tensor_model_parallel_size", 1), given.get("pipeline_model_parallel_size", 1)
    vpp = given.get("num_virtual_stages_per_pipeline_rank", 1)
    per_stage = given.get("num_layers_per_virtual_pipeline_stage")
    if per_stage is not None:
        if num_layers % (pp * per_stage):
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_stage}: {num_layers} layers are not a "
                             f"multiple of {pp} stages x {per_stage}. Fix: choose a count that divides "
                             f"{num_layers // pp}")
        vpp = num_layers // (pp * per_stage)
    granularity, method = given.get("recompute_granularity"), given.get("recompute_method")
    if granularity == "selective":
        raise ValueError("--recompute-granularity selective: not supported by megatron-het (plans recompute whole "
                         "layers). Fix: use --recompute-granularity full, or drop it")
    if granularity is None and (method is not None or "recompute_num_layers" in given):
        raise ValueError("--recompute-method/--recompute-num-layers need --recompute-granularity full (as in "
                         "Megatron-LM). Fix: add --recompute-granularity full")
    block = given.get("recompute_num_layers", 1) if method == "block" else 0
    if granularity == "full" and method != "block" and given.get("recompute_num_layers", 1) != 1:
        notes.append(f"note: --recompute-method uniform --recompute-num-layers {given['recompute_num_layers']}: "
                     "recomputed one layer per unit (the same numbers; the memory model prices units of one)")
    return LayoutFlags(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_size=vpp,
                       decoder_first_pipeline_num_layers=given.get("decoder_first_pipeline_num_layers"),
                       decoder_last_pipeline_num_layers=given.get("decoder_last_pipeline_num_layers"),
                       recompute=granularity == "full", recompute_num_layers=block), notes


# Megatron-LM's split when --split is not given (megatron/training/arguments.py, "legacy default")
MEGATRON_DEFAULT_SPLIT = "969,30,1"


def _from_megatron(values: dict[str, dict[str, object]], given: frozenset[str], ns: argparse.Namespace) -> list[str]:
    """Megatron's None defaults as this runtime's values (in place); returns start-up notes."""
    notes: list[str] = []
    loop, data, train, model, run = (values[k] for k in ("loop", "data", "train", "model", "run"))
    board = values["tensorboard"]
    board["wandb_exp_name"] = board["wandb_exp_name"] or ""
    if board["wandb_project"] and not board["wandb_save_dir"] and loop["save"]:
        board["wandb_save_dir"] = os.path.join(loop["save"], "wandb")  # Megatron-LM's default
    for name in ("eval_interval", "save_interval", "check_weight_hash_interval", "exit_interval",
                 "exit_duration_in_mins", "save_retain_interval"):
        loop[name] = loop[name] or 0  # Megatron: None = never
    tensorboard_dir = values["tensorboard"]["log_dir"]
    if tensorboard_dir:  # where Megatron-LM writes torch profiler traces
        loop["profile_trace_dir"] = os.path.join(os.path.dirname(os.path.abspath(tensorboard_dir)), "torch_profile")
    if loop["profile"] and not loop["use_pytorch_profiler"]:
        import torch

        if not torch.cuda.is_available():
            notes.append("note: --profile without --use-pytorch-profiler opens nsys's capture range "
                         "(cudaProfilerStart); this host has no GPU, so nothing is captured. Add "
                         "--use-pytorch-profiler for a torch trace")
    data["split"] = data["split"] or MEGATRON_DEFAULT_SPLIT
    if data["tokenizer_type"] is None and data["tokenizer_model"]:
        data["tokenizer_type"] = "SentencePieceTokenizer"
        notes.append("note: --tokenizer-type not given: --tokenizer-model is read as a SentencePieceTokenizer")
    if data["tokenizer_type"] is None and data["vocab_file"] and data["merge_file"]:
        data["tokenizer_type"] = "GPT2BPETokenizer"  # what Megatron-LM's GPT functional tests' vocab/merges are
        notes.append("note: --tokenizer-type not given: --vocab-file/--merge-file are read as a GPT2BPETokenizer")
    data["tokenizer_type"] = data["tokenizer_type"] or "SentencePieceTokenizer"
    if data["tokenizer_type"] in ("NullTokenizer", "TikTokenizer"):  # Megatron passes them --vocab-size
        data["tokenizer_vocab_size"] = ns.vocab_size
    train["loss_scale_window"] = int(train["loss_scale_window"])
    if "transformer_impl" not in given:  # Megatron's default transformer_engine; here: TE where it imports
        train["transformer_impl"] = None
    if run["group_query_attention"]:
        model["num_query_groups"] = ns.num_query_groups
    elif model["num_query_groups"] is not None:
        notes.append(f"note: --num-query-groups {model['num_query_groups']} is ignored without "
                     "--group-query-attention (as in Megatron-LM): every head has its own keys and values")
        model["num_query_groups"] = None
    return notes


def _batch_from_plan(train: dict[str, object], plan_source: str | None, layout, cluster: ClusterSpec) -> list[str]:
    """--micro-batch-size/--global-batch-size not given: the plan file's; with Megatron's layout flags
    the global batch is Megatron's micro-batch x data-parallel size. Notes, or ValueError."""
    missing = [n for n in ("micro_batch_size", "global_batch_size") if train[n] is None]
    if not missing:
        return []
    names = " and ".join("--" + n.replace("_", "-") for n in missing)
    if layout is not None and train["micro_batch_size"] is None:
        raise ValueError("--micro-batch-size: required (Megatron-LM has no default). Fix: pass --micro-batch-size N")
    if layout is not None:
        dp = cluster.num_gpus // (layout.tensor_model_parallel_size * layout.pipeline_model_parallel_size)
        train["global_batch_size"] = train["micro_batch_size"] * max(dp, 1)
        return [f"note: --global-batch-size not given: micro-batch x data-parallel size = {train['micro_batch_size']}"
                f" x {dp} (Megatron-LM's default)"]
    if plan_source is None or plan_source == "auto":
        raise ValueError(f"{names}: not given, and the planner needs them to search. Fix: pass {names}")
    from megatron_het.plan import load_any_plan

    plan = load_any_plan(plan_source)
    sizes = {"global_batch_size": plan.global_batch_size,
             "micro_batch_size": getattr(plan, "micro_batch_size", None) or plan.ranks[0].micro_batch_size}
    for n in missing:
        train[n] = sizes[n]
    return [f"note: {names} not given: the plan's ({', '.join(f'{n} {sizes[n]}' for n in missing)})"]


# ModelSpec fields whose value, without a model file, is Megatron-LM's default (its parser's) rather
# than the recipe ModelSpec derives from --swiglu: a Megatron script builds the model Megatron would
ARCHITECTURE = ("normalization", "position_embedding_type", "add_bias_linear", "hidden_dropout", "attention_dropout")


def model_from_args(overrides: dict[str, object], model_file: str | None, *, tokenizer_vocab: int | None,
                    megatron_defaults: dict[str, object] | None = None) -> ModelSpec:
    """The model: ``overrides`` (flags given) over the model file as written; without a file, over
    ``megatron_defaults`` (the ``ARCHITECTURE`` fields' values in Megatron's parser)."""
    from megatron_het.cluster import model_from_dict

    base: dict = {} if model_file else dict(megatron_defaults or {})
    if model_file:
        from megatron_het.cluster.loader import read_yaml

        load_model(model_file)  # a bad file is named as itself, before the flags are merged in
        # the file as written, not its resolved defaults: --hidden-size must still move kv_channels and ffn
        base = {k: v for k, v in dict(read_yaml(model_file)).items() if v is not None}
    base.update({k: v for k, v in overrides.items() if v is not None})
    if "vocab_size" not in base and tokenizer_vocab is not None:
        base["vocab_size"] = tokenizer_vocab
    if tokenizer_vocab is not None and base.get("vocab_size", 0) < tokenizer_vocab:
        raise ConfigError(f"the tokenizer has {tokenizer_vocab} pieces", field="--vocab-size",
                          value=base.get("vocab_size"), fix=f"use --vocab-size >= {tokenizer_vocab} or omit it")
    return model_from_dict(base, source=model_file or "command line")


def tokenizer_spec(data: DataConfig, *, model_vocab_size: int | None = None):
    """The run's tokenizer flags as the data layer's TokenizerSpec (validated: DataInputError). Mock
    data with no tokenizer given (and ``model_vocab_size`` known): a NullTokenizer over the model's
    vocabulary, as Megatron-LM's mock-data scripts use."""
    from megatron_het.data.tokenizer import SENTENCEPIECE_TYPES, TokenizerSpec

    if (data.mock_data and model_vocab_size is not None and not data.tokenizer_model
            and data.tokenizer_type in SENTENCEPIECE_TYPES):
        return TokenizerSpec(tokenizer_type="NullTokenizer", vocab_size=model_vocab_size)
    return TokenizerSpec(tokenizer_type=data.tokenizer_type, tokenizer_model=data.tokenizer_model,
                         vocab_file=data.vocab_file, merge_file=data.merge_file, vocab_size=data.tokenizer_vocab_size)


def tokenizer_vocab(data: DataConfig) -> int | None:
    """The tokenizer's size, needed before the model is known (Megatron pads from it); None with
    --mock-data. A file that does not load is a ConfigError naming the flag and the file."""
    from megatron_het.data.tokenizer import SENTENCEPIECE_TYPES, build_gpt_tokenizer

    if data.mock_data:
        return None
    if data.tokenizer_type not in SENTENCEPIECE_TYPES:
        try:
            return int(build_gpt_tokenizer(tokenizer_spec(data)).vocab_size)
        except UserError as e:
            raise ConfigError(str(e), field="--tokenizer-type", value=data.tokenizer_type,
                              fix="pass the files that tokenizer type reads") from None
    if not data.tokenizer_model:
        return None
    from megatron_het.data import load_tokenizer

    path = data.tokenizer_model
    fix = "pass the SentencePiece .model file written by tools/train_tokenizer.py"
    if not Path(path).is_file():
        raise ConfigError("is a directory, not a file" if Path(path).is_dir() else "file not found",
                          field="--tokenizer-model", value=path, fix=fix)
    try:
        return int(load_tokenizer(path, tokenizer_type=data.tokenizer_type).vocab_size)
    except UserError as e:  # the data layer names its own field; the user typed the flag
        found = re.search(r"'[^']*' (.*?)\. Fix:", str(e))
        raise ConfigError(found.group(1) if found else str(e), field="--tokenizer-model", value=path,
                          fix=fix) from None


def parse_args(argv: list[str] | None = None) -> PretrainArgs:
    import sys

    from megatron_het.runtime.flag_policy import review_flags
    from megatron_het.runtime.megatron_parser import given_dests, megatron_dests, option_name

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(argv)
    given = given_dests(parser, argv)
    try:
        values = _sections(ns, parser, given)
    except ConfigError as e:
        parser.error(str(e))
    data, run, train = values["data"], values["run"], values["train"]
    notes = _from_megatron(values, given, ns)
    if not data["mock_data"] and not data["data_path"]:
        parser.error("give --data-path PREFIX (with --tokenizer-model) or --mock-data")
    if data["data_path"] and not data["tokenizer_model"] and data["tokenizer_type"] in (
            "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        parser.error("--data-path needs --tokenizer-model (the SentencePiece model used by preprocess_data.py)")
    if data["data_path"] or data["tokenizer_type"] != "SentencePieceTokenizer":
        try:
            tokenizer_spec(DataConfig(**data))
        except UserError as e:
            parser.error(str(e))
    if train["lr"] is None:  # Megatron has no default either
        parser.error("--lr: required (Megatron-LM has no default)")
    if (train["train_iters"] is None) == (train["train_samples"] is None):
        parser.error("give one of --train-iters and --train-samples (as Megatron-LM)")
    data_config = DataConfig(**data)
    vocab = tokenizer_vocab(data_config)  # a bad file is one line naming the flag, not a usage message
    try:
        architecture = {f: getattr(ns, parser._option_string_actions[flag.name].dest) for flag in FLAGS
                        if (f := flag.to.removeprefix("model.")) in ARCHITECTURE}
        model = model_from_args(values["model"], run["model_file"], tokenizer_vocab=vocab,
                                megatron_defaults=architecture)
        if not ns.add_position_embedding and model.position_embedding_type != "rope":
            raise ValueError("--no-position-embedding: deprecated, and Megatron-LM refuses it without rope. Fix: use "
                             "--position-embedding-type none")
        cluster = load_cluster(run["cluster_file"])
        layout, layout_notes = layout_from_args(run, model.num_layers)
        notes += layout_notes + _batch_from_plan(train, run["plan_source"], layout, cluster)
        if train["train_iters"] is None:  # Megatron's update_train_iters without batch ramp-up
            train["train_iters"] = train["train_samples"] // train["global_batch_size"]
            if train["train_iters"] < 1:
                raise ValueError(f"--train-samples {train['train_samples']}: fewer than one global batch of "
                                 f"{train['global_batch_size']}. Fix: raise --train-samples")
        honoured = {parser._option_string_actions[f.name].dest for f in FLAGS}
        defaults = {dest: action.default for dest, action in megatron_dests(parser).items()}
        notes += review_flags(ns, defaults=defaults, given=given, honoured=honoured, model=model,
                              spell=lambda dest: option_name(parser, dest))
        if train["transformer_impl"] == "transformer_engine" and not _transformer_engine_builds(None):
            raise ValueError("--transformer-impl transformer_engine: transformer-engine is not importable on a GPU "
                             "in this process. Fix: pass --transformer-impl local, or install transformer-engine "
                             "on the GPU nodes")  # here, not in every rank's model build after rendezvous
        if model.is_moe and model.add_bias_linear and run["plan_source"] is None:
            # without a plan file the flags decide the expert grid (a plan file's: Plan.validate)
            ep = run["expert_model_parallel_size"]
            etp = run["expert_tensor_parallel_size"] or run["tensor_model_parallel_size"] or 1
            if ep == 1 or etp != 1:
                raise ValueError("--num-experts with linear biases: megatron-core trains expert biases only with "
                                 f"expert parallelism and expert-TP 1 (got --expert-model-parallel-size {ep}, expert-TP "
                                 f"{etp}). Fix: add --disable-bias-linear, or --expert-model-parallel-size > 1 with "
                                 "--expert-tensor-parallel-size 1")
        if model.layernorm_zero_centered_gamma and not _transformer_engine_builds(train["transformer_impl"]):
            raise ValueError("--apply-layernorm-1p: megatron-core's local layers (no transformer-engine in this "
                             "process) have no zero-centred norm. Fix: run where transformer-engine is installed, "
                             "or drop --apply-layernorm-1p")
        train_config = TrainConfig(**train)
        loop = LoopConfig(**values["loop"])
        loop.profile_config()  # a bad capture window is refused here, before any rendezvous
        check_load_path(loop)
        tensorboard = tensorboard_from_args(values["tensorboard"])
        resilience = resilience_from_args(run)
        if run["staggered_step"] and train_config.clip_grad > 0:
            raise ValueError(f"--hetero-staggered-step: each stage steps before the global gradient norm exists, "
                             f"so it cannot clip (--clip-grad {train_config.clip_grad}). Fix: add --clip-grad 0")
    except ValueError as e:  # UserError included: the flag's value is wrong
        parser.error(str(e))
    return PretrainArgs(model=model, train=train_config, data=data_config, loop=loop, cluster=cluster,
                        plan_source=run["plan_source"], layout=layout, profile=tuple(run["profile"]) if run["profile"] else None,
                        no_emulation=bool(run["no_emulation"]), sequence_parallel=bool(run["sequence_parallel"]),
                        tp_comm_overlap=bool(run["tp_comm_overlap"]), tensorboard=tensorboard,
                        use_distributed_optimizer=bool(run["use_distributed_optimizer"]), resilience=resilience,
                        expert_model_parallel_size=run["expert_model_parallel_size"],
                        expert_tensor_parallel_size=run["expert_tensor_parallel_size"],
                        staggered_step=bool(run["staggered_step"]), device_stand_in=bool(run["device_stand_in"]),
                        tensor_model_parallel_size=run["tensor_model_parallel_size"],
                        pipeline_model_parallel_size=run["pipeline_model_parallel_size"], notes=tuple(notes))


def _transformer_engine_builds(transformer_impl: str | None) -> bool:
    """Whether the layers will be transformer-engine's (model/gpt.layer_spec's choice), before rendezvous."""
    if transformer_impl == "local":
        return False
    from megatron_het.platform import detect_optional_accelerators

    return detect_optional_accelerators().transformer_engine


def check_load_path(loop: LoopConfig) -> None:
    """--load must name an existing directory: a mistyped path would otherwise train from scratch.
    An existing directory without a checkpoint still starts from scratch (said in the log), and so
    does a missing one that is also --save (Megatron's restartable ``--save DIR --load DIR``: the
    first run creates it)."""
    path = loop.load
    if not path or os.path.isdir(path):
        return
    if os.path.exists(path):
        raise ValueError(f"--load {path}: is a file, not a checkpoint directory. Fix: pass the directory given to "
                         "--save (the one holding latest_checkpointed_iteration.txt), or drop --load")
    if loop.save and os.path.abspath(loop.save) == os.path.abspath(path):
        return
    raise ValueError(f"--load {path}: no such directory. Fix: check the spelling, create the directory, or drop "
                     "--load to start from scratch")


def tensorboard_from_args(values: dict[str, object]) -> TensorBoardConfig | None:
    """The TensorBoard settings, or None without --tensorboard-dir (the --log-* flags then do nothing)."""
    if values["log_dir"] is None:
        if values["wandb_project"]:
            raise ValueError(f"--wandb-project {values['wandb_project']}: W&B mirrors the TensorBoard writer's "
                             "scalars, as in Megatron-LM. Fix: add --tensorboard-dir DIR")
        return None
    from megatron_het.runtime.tensorboard_log import require_tensorboard, require_wandb

    config = TensorBoardConfig(**values)
    require_tensorboard()  # every rank parses: all fail together, before any process group exists
    if config.wandb_project:
        require_wandb()
    return config


def resilience_from_args(run: dict[str, object]) -> ResilienceOptions | None:
    """The --hetero-resilience settings, or None when it is off (its knobs then must not be given)."""
    knobs = ("resilience_store", "heartbeat_interval", "failure_timeout", "resilience_policy", "resilience_report",
             "inject_fault")
    if not run["resilience"]:
        given = [f"--hetero-{k.replace('_', '-')}" for k in knobs if run[k] is not None]
        if given:
            raise ValueError(f"{given[0]}: needs --hetero-resilience. Fix: add --hetero-resilience or drop {given[0]}")
        return None
    if run["resilience_store"] is None:
        raise ValueError("--hetero-resilience-store: missing. Fix: start `python -m megatron_het.cli.resilience_store "
                         "--host HOST --port PORT` outside the ranks and pass HOST:PORT (pretrain_scripts/*.sh and "
                         "tools/slurm.py do this when --hetero-resilience is given)")
    host, port = parse_store(str(run["resilience_store"]))
    optional = {"heartbeat_interval_s": run["heartbeat_interval"], "failure_timeout_s": run["failure_timeout"],
                "policy": run["resilience_policy"], "report_dir": run["resilience_report"]}
    fault = FaultInjection.parse(str(run["inject_fault"])) if run["inject_fault"] is not None else None
    return ResilienceOptions(store_host=host, store_port=port, fault=fault,
                             **{k: v for k, v in optional.items() if v is not None})
