"""Command-line arguments of pretrain_gpt.py: Megatron-LM's flag names plus --hetero-*.

Each flag is declared once in ``FLAGS`` (name, type, help, and the config field it fills); its
default is that field's default in ``train/config.py``. ``parse_args`` builds the typed objects from it; no argparse Namespace leaves this
module. Bad values exit with argparse's message naming the flag (code 2); a tokenizer file that
does not load is a one-line ConfigError naming --tokenizer-model and the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

from megatron_het.cluster import ClusterSpec, ConfigError, ModelSpec, load_cluster, load_model
from megatron_het.errors import UserError
from megatron_het.runtime.resilience_options import FaultInjection, ResilienceOptions, parse_store
from megatron_het.train.config import DataConfig, LoopConfig, TensorBoardConfig, TrainConfig


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
    Flag("--swiglu", "model.swiglu", bool),
    Flag("--untie-embeddings-and-output-weights", "model.untie_embeddings_and_output_weights", bool),
    Flag("--micro-batch-size", "train.micro_batch_size", int, required=True),
    Flag("--global-batch-size", "train.global_batch_size", int, required=True),
    Flag("--train-iters", "train.train_iters", int, required=True),
    *(Flag(f"--{f.replace('_', '-')}", f"train.{f}", float) for f in (
        "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad")),
    Flag("--lr-decay-style", "train.lr_decay_style", help="constant, linear or cosine"),
    *(Flag(f"--{f.replace('_', '-')}", f"train.{f}", int) for f in ("lr_warmup_iters", "seed", "log_interval")),
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
                                                                "tokenizer_model")),
    Flag("--mock-data", "data.mock_data", bool, "synthetic tokens instead of --data-path"),
    Flag("--save", "loop.save"),
    Flag("--load", "loop.load"),
    *(Flag(f"--{f.replace('_', '-')}", f"loop.{f}", int) for f in ("save_interval", "eval_interval", "eval_iters")),
    Flag("--check-weight-hash-across-dp-replicas-interval", "loop.check_weight_hash_interval", int,
         "iterations between checks that every holder of each parameter (replicas of any layout, TP peers, tied "
         "copies) holds the same value; also before the first step (default: never)"),
    Flag("--tensorboard-dir", "tensorboard.log_dir", help="write TensorBoard event files here (rank 0 writes)"),
    Flag("--tensorboard-log-interval", "tensorboard.log_interval", int, "iterations between TensorBoard points"),
    Flag("--tensorboard-queue-size", "tensorboard.queue_size", int, "events buffered before a write to disk"),
    Flag("--log-timers-to-tensorboard", "tensorboard.log_timers", bool, "iteration time, per-stage compute/idle"),
    Flag("--log-memory-to-tensorboard", "tensorboard.log_memory", bool, "peak and current memory (CPU: RSS)"),
    Flag("--log-throughput", "tensorboard.log_throughput", bool, "tokens/s and samples/s to TensorBoard"),
    Flag("--sequence-parallel", "run.sequence_parallel", bool, "turn on the plan's sequence_parallel"),
    Flag("--tp-comm-overlap", "run.tp_comm_overlap", bool, "chunked TP collective/GEMM overlap on every stage with "
         "TP > 1 (plans can also choose per stage); needs sequence parallelism"),
    Flag("--hetero-tp-comm-overlap-chunks", "train.tp_comm_overlap_chunks", int, "pieces per overlapped GEMM"),
    Flag("--overlap-grad-reduce", "train.overlap_grad_reduce", bool, "reduce gradient buckets during the backward"),
    Flag("--ddp-bucket-size", "train.ddp_bucket_size", int, "parameters per gradient bucket (default: "
         "megatron-core's max(40M, 1M x replicas))"),
    Flag("--use-distributed-optimizer", "run.use_distributed_optimizer", bool, "shard fp32 main parameters and "
         "Adam moments over every holder of each parameter (the plan records it)"),
    Flag("--overlap-param-gather", "train.overlap_param_gather", bool, "with the distributed optimizer: all-gather "
         "the updated parameters while the next forward runs"),
    Flag("--hetero-cluster", "run.cluster_file", help="CLUSTER.yaml", required=True),
    Flag("--hetero-plan", "run.plan_source", help="a plan file (tools/plan.py writes one) or 'auto' to run the "
         "planner at start-up", required=True),
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
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Train a GPT with megatron-core on a heterogeneous cluster (launch with torchrun).")
    groups: dict = {}  # section -> its argument group
    for flag in FLAGS:
        section, field = flag.to.split(".")
        fields = {f.name: f.default for f in dataclasses.fields(CONFIGS[section])} if section in CONFIGS else {}
        default = None if fields.get(field, dataclasses.MISSING) is dataclasses.MISSING else fields[field]
        kw: dict = {"dest": flag.to, "help": flag.help or None, "required": flag.required}
        if flag.type is bool:  # a switch; model switches stay None unless given (the file decides)
            kw.update(action="store_true", default=default)
        else:
            kw.update(default=default, type=str if flag.type is tuple else flag.type, metavar=field.upper(),
                      nargs="+" if flag.type is tuple else None)
        groups.setdefault(section, p.add_argument_group(section)).add_argument(flag.name, **kw)
    return p


@dataclass(frozen=True, kw_only=True)
class PretrainArgs:
    """Everything a run needs, validated."""

    model: ModelSpec
    train: TrainConfig
    data: DataConfig
    loop: LoopConfig
    cluster: ClusterSpec
    plan_source: str  # a path or "auto"
    profile: tuple[str, ...] | None  # measured profiles for plan_source "auto"
    no_emulation: bool  # run every island at host speed despite the cluster's emulation block
    sequence_parallel: bool  # turn on the plan's sequence parallelism
    tp_comm_overlap: bool  # overlap TP communication on every stage with TP > 1
    tensorboard: TensorBoardConfig | None  # None: no --tensorboard-dir
    use_distributed_optimizer: bool = False  # turn on the plan's distributed optimizer (runtime/plan_record.py)
    resilience: ResilienceOptions | None = None  # None: no --hetero-resilience
    device_stand_in: bool = False  # ranks may run islands of another vendor (runtime/device_check.py)
    staggered_step: bool = False  # --hetero-staggered-step


def _sections(ns: argparse.Namespace) -> dict[str, dict[str, object]]:
    """The parsed values grouped by section (the one mapping of every flag)."""
    out: dict[str, dict[str, object]] = {}
    for flag in FLAGS:
        section, field = flag.to.split(".")
        value = getattr(ns, flag.to)
        out.setdefault(section, {})[field] = tuple(value or ()) if flag.type is tuple else value
    return out


def model_from_args(overrides: dict[str, object], model_file: str | None, *, tokenizer_vocab: int | None) -> ModelSpec:
    from megatron_het.cluster import model_from_dict

    base: dict = {}
    if model_file:
        base = {k: v for k, v in dataclasses.asdict(load_model(model_file)).items() if v is not None}
    base.update({k: v for k, v in overrides.items() if v is not None})
    if "vocab_size" not in base and tokenizer_vocab is not None:
        base["vocab_size"] = tokenizer_vocab
    if tokenizer_vocab is not None and base.get("vocab_size", 0) < tokenizer_vocab:
        raise ConfigError(f"the tokenizer has {tokenizer_vocab} pieces", field="--vocab-size",
                          value=base.get("vocab_size"), fix=f"use --vocab-size >= {tokenizer_vocab} or omit it")
    return model_from_dict(base, source=model_file or "command line")


def tokenizer_vocab(data: DataConfig) -> int | None:
    """The tokenizer's size, needed before the model is known (Megatron pads from it); None with
    --mock-data. A file that does not load is a ConfigError naming --tokenizer-model and the file."""
    if data.mock_data or not data.tokenizer_model:
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
    parser = build_parser()
    ns = parser.parse_args(argv)
    values = _sections(ns)
    data, run = values["data"], values["run"]
    if not data["mock_data"] and not data["data_path"]:
        parser.error("give --data-path PREFIX (with --tokenizer-model) or --mock-data")
    if data["data_path"] and not data["tokenizer_model"]:
        parser.error("--data-path needs --tokenizer-model (the SentencePiece model used by preprocess_data.py)")
    data_config = DataConfig(**data)
    vocab = tokenizer_vocab(data_config)  # a bad file is one line naming the flag, not a usage message
    try:
        model = model_from_args(values["model"], run["model_file"], tokenizer_vocab=vocab)
        cluster = load_cluster(run["cluster_file"])
        train = TrainConfig(**values["train"])
        loop = LoopConfig(**values["loop"])
        check_load_path(loop)
        tensorboard = tensorboard_from_args(values["tensorboard"])
        resilience = resilience_from_args(run)
        if run["staggered_step"] and train.clip_grad > 0:
            raise ValueError(f"--hetero-staggered-step: each stage steps before the global gradient norm exists, "
                             f"so it cannot clip (--clip-grad {train.clip_grad}). Fix: add --clip-grad 0")
    except ValueError as e:  # UserError included: the flag's value is wrong
        parser.error(str(e))
    return PretrainArgs(model=model, train=train, data=data_config, loop=loop, cluster=cluster,
                        plan_source=run["plan_source"], profile=tuple(run["profile"]) if run["profile"] else None, no_emulation=bool(run["no_emulation"]),
                        sequence_parallel=bool(run["sequence_parallel"]), tp_comm_overlap=bool(run["tp_comm_overlap"]),
                        tensorboard=tensorboard, use_distributed_optimizer=bool(run["use_distributed_optimizer"]),
                        resilience=resilience, staggered_step=bool(run["staggered_step"]),
                        device_stand_in=bool(run["device_stand_in"]))


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
        return None
    from megatron_het.runtime.tensorboard_log import require_tensorboard

    config = TensorBoardConfig(**values)
    require_tensorboard()  # every rank parses: all fail together, before any process group exists
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
