"""Command-line arguments of pretrain_gpt.py: Megatron-LM's flag names plus --hetero-*.

Parsing builds typed objects (ModelSpec, TrainConfig, ...) at the boundary; bad values become
``SystemExit`` with argparse's message naming the flag.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_het.cluster import ClusterSpec, ConfigError, ModelSpec, load_cluster, load_model
from megatron_het.runtime.train_config import TrainConfig

if TYPE_CHECKING:  # the module imports torch: only --tensorboard-dir pays for it at parse time
    from megatron_het.runtime.tensorboard_log import TensorBoardConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Train a GPT with megatron-core on a heterogeneous cluster (launch with torchrun).")
    m = p.add_argument_group("model (Megatron-LM names)")
    m.add_argument("--hetero-model", metavar="MODEL.yaml", help="model file; flags below override its fields")
    m.add_argument("--num-layers", type=int)
    m.add_argument("--hidden-size", type=int)
    m.add_argument("--num-attention-heads", type=int)
    m.add_argument("--num-query-groups", type=int)
    m.add_argument("--ffn-hidden-size", type=int)
    m.add_argument("--seq-length", type=int)
    m.add_argument("--max-position-embeddings", type=int)
    m.add_argument("--vocab-size", type=int, help="unpadded vocabulary (default: the tokenizer's)")
    m.add_argument("--swiglu", action="store_true", default=None)
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)

    t = p.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=int, required=True)
    t.add_argument("--global-batch-size", type=int, required=True)
    t.add_argument("--train-iters", type=int, required=True)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--min-lr", type=float, default=0.0)
    t.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="constant")
    t.add_argument("--lr-warmup-iters", type=int, default=0)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.999)
    t.add_argument("--adam-eps", type=float, default=1e-8)
    t.add_argument("--clip-grad", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=1234)

    d = p.add_argument_group("data")
    d.add_argument("--data-path", nargs="+", help="indexed dataset prefix (or weight prefix ... pairs)")
    d.add_argument("--split", default="949,50,1")
    d.add_argument("--data-cache-path")
    d.add_argument("--tokenizer-type", default="SentencePieceTokenizer")
    d.add_argument("--tokenizer-model")
    d.add_argument("--mock-data", action="store_true", help="synthetic tokens instead of --data-path")

    c = p.add_argument_group("checkpoints and logging")
    c.add_argument("--save")
    c.add_argument("--load")
    c.add_argument("--save-interval", type=int, default=0)
    c.add_argument("--log-interval", type=int, default=1)
    c.add_argument("--eval-interval", type=int, default=0)
    c.add_argument("--eval-iters", type=int, default=0)
    c.add_argument("--tensorboard-dir", metavar="DIR", help="write TensorBoard event files here (rank 0 writes)")
    c.add_argument("--tensorboard-log-interval", type=int, default=1, help="iterations between TensorBoard points")
    c.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="TensorBoard events buffered before they are written to disk")
    c.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="iteration time and every stage's compute/idle time")
    c.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="peak and current memory, per stage (CPU ranks: process RSS)")
    c.add_argument("--log-throughput", action="store_true", help="tokens/s and samples/s to TensorBoard")

    o = p.add_argument_group("overlap (Megatron-LM names)")
    o.add_argument("--sequence-parallel", action="store_true", help="turn on the plan's sequence_parallel")
    o.add_argument("--tp-comm-overlap", action="store_true",
                   help="chunked TP collective/GEMM overlap on every stage with TP > 1 (plans can also choose per "
                        "stage with tp_comm_overlap); needs sequence parallelism")
    o.add_argument("--hetero-tp-comm-overlap-chunks", type=int, default=4,
                   help="pieces each overlapped GEMM is split into")
    o.add_argument("--overlap-grad-reduce", action="store_true",
                   help="launch each gradient bucket's reduction during the last backward")
    o.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="parameters per gradient bucket (default: megatron-core's max(40M, 1M x replicas))")

    h = p.add_argument_group("heterogeneous cluster")
    h.add_argument("--hetero-cluster", metavar="CLUSTER.yaml", required=True)
    h.add_argument("--hetero-plan", metavar="PLAN.json|auto", required=True,
                   help="a plan file (tools/plan.py writes one) or 'auto' to run the planner at start-up")
    h.add_argument("--hetero-profile", metavar="PROFILE.json", help="measured profile for --hetero-plan auto")
    h.add_argument("--no-emulation", action="store_true",
                   help="ignore the cluster file's emulation block (CPU runs at full speed everywhere)")
    return p


@dataclass(frozen=True, kw_only=True)
class PretrainArgs:
    """Everything a run needs, validated."""

    model: ModelSpec
    train: TrainConfig
    cluster: ClusterSpec
    plan_source: str  # a path or "auto"
    tensorboard: TensorBoardConfig | None  # None: no --tensorboard-dir
    raw: argparse.Namespace  # every parsed flag, for the ones not lifted into typed fields


_MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                "seq_length", "max_position_embeddings", "vocab_size", "swiglu",
                "untie_embeddings_and_output_weights")


def model_from_args(ns: argparse.Namespace, *, tokenizer_vocab: int | None) -> ModelSpec:
    from megatron_het.cluster import model_from_dict

    base: dict = {}
    if ns.hetero_model:
        import dataclasses

        base = {k: v for k, v in dataclasses.asdict(load_model(ns.hetero_model)).items() if v is not None}
    for name in _MODEL_FLAGS:
        value = getattr(ns, name)
        if value is not None:
            base[name] = value
    if "vocab_size" not in base and tokenizer_vocab is not None:
        base["vocab_size"] = tokenizer_vocab
    if tokenizer_vocab is not None and base.get("vocab_size", 0) < tokenizer_vocab:
        raise ConfigError(f"the tokenizer has {tokenizer_vocab} pieces", field="--vocab-size",
                          value=base.get("vocab_size"), fix=f"use --vocab-size >= {tokenizer_vocab} or omit it")
    return model_from_dict(base, source=ns.hetero_model or "command line")


def parse_args(argv: list[str] | None = None, *, tokenizer_vocab: int | None = None) -> PretrainArgs:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not ns.mock_data and not ns.data_path:
        parser.error("give --data-path PREFIX (with --tokenizer-model) or --mock-data")
    if ns.data_path and not ns.tokenizer_model:
        parser.error("--data-path needs --tokenizer-model (the SentencePiece model used by preprocess_data.py)")
    try:
        model = model_from_args(ns, tokenizer_vocab=tokenizer_vocab)
        cluster = load_cluster(ns.hetero_cluster)
        train = TrainConfig(micro_batch_size=ns.micro_batch_size, global_batch_size=ns.global_batch_size,
                            train_iters=ns.train_iters, lr=ns.lr, min_lr=ns.min_lr, lr_decay_style=ns.lr_decay_style,
                            lr_warmup_iters=ns.lr_warmup_iters, weight_decay=ns.weight_decay,
                            adam_beta1=ns.adam_beta1, adam_beta2=ns.adam_beta2, adam_eps=ns.adam_eps,
                            clip_grad=ns.clip_grad, seed=ns.seed, log_interval=ns.log_interval,
                            tp_comm_overlap_chunks=ns.hetero_tp_comm_overlap_chunks,
                            overlap_grad_reduce=ns.overlap_grad_reduce, ddp_bucket_size=ns.ddp_bucket_size)
        tensorboard = tensorboard_from_args(ns)
    except (ConfigError, ValueError) as e:
        parser.error(str(e))
    return PretrainArgs(model=model, train=train, cluster=cluster, plan_source=ns.hetero_plan,
                        tensorboard=tensorboard, raw=ns)


def tensorboard_from_args(ns: argparse.Namespace) -> TensorBoardConfig | None:
    """The TensorBoard settings, or None without --tensorboard-dir (the --log-* flags then do nothing)."""
    if ns.tensorboard_dir is None:
        return None
    from megatron_het.runtime.tensorboard_log import TensorBoardConfig, require_tensorboard

    config = TensorBoardConfig(log_dir=ns.tensorboard_dir, log_interval=ns.tensorboard_log_interval,
                               queue_size=ns.tensorboard_queue_size, log_timers=ns.log_timers_to_tensorboard,
                               log_memory=ns.log_memory_to_tensorboard, log_throughput=ns.log_throughput)
    require_tensorboard()  # every rank parses: all fail together, before any process group exists
    return config
