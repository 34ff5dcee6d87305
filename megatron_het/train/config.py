"""Settings of a training run as typed objects (Megatron-LM's flag names, minus dashes).

``runtime/arguments.py`` declares each command-line flag once and maps it into these; the
defaults live here only. No torch import: parsing stays fast.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")  # Megatron-LM's choices
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Hyper-parameters of one training run; validated on construction."""

    micro_batch_size: int  # samples per micro-batch
    global_batch_size: int  # samples per optimizer step, over all replicas
    train_iters: int  # optimizer steps
    lr: float = 1e-3  # peak learning rate
    min_lr: float = 0.0  # floor of the decay
    lr_decay_style: str = "constant"  # LR_DECAY_STYLES (megatron-core's OptimizerParamScheduler)
    lr_warmup_iters: int = 0  # linear warm-up iterations from lr_warmup_init to lr
    # The rest of Megatron-LM's schedule (train/lr_schedule.py runs megatron-core's scheduler on them):
    lr_decay_iters: int | None = None  # iterations the decay spans; None: train_iters
    lr_warmup_fraction: float | None = None  # warm-up as a fraction of the decay span (replaces the iterations)
    lr_warmup_init: float = 0.0  # the learning rate warm-up starts from
    lr_wsd_decay_iters: int | None = None  # WSD: iterations of the final anneal (required with WSD)
    lr_wsd_decay_style: str = "exponential"  # WSD anneal: exponential | linear | cosine | minus_sqrt
    # --decoupled-lr: the peak rate of the word embedding and output layer (megatron-core's
    # is_embedding_or_output_parameter), on the same schedule; None: theirs is --lr
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None  # their floor; None: --min-lr
    # Sample-based training (--train-samples): the schedule counts samples; train_iters is then
    # train_samples // global_batch_size, as Megatron-LM's update_train_iters without ramp-up
    train_samples: int | None = None
    lr_decay_samples: int | None = None  # None: train_samples
    lr_warmup_samples: int = 0
    lr_wsd_decay_samples: int | None = None
    weight_decay: float = 0.01  # decoupled (AdamW) weight decay
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # global gradient-norm clip; 0 disables
    seed: int = 1234  # model initialisation and data order
    log_interval: int = 1  # iterations between log lines
    log_params_norm: bool = False  # --log-params-norm: the global parameter norm after each step, in the log line
    log_num_zeros_in_grad: bool = False  # --log-num-zeros-in-grad: zero gradient elements, in the log line
    # pieces per GEMM of the chunked TP collective/GEMM overlap on stages whose plan sets
    # tp_comm_overlap (comm/overlap.py); a shard whose rows it does not divide uses fewer
    tp_comm_overlap_chunks: int = 4
    # Megatron's --overlap-grad-reduce: cross-replica gradient buckets are reduced from gradient
    # hooks during each stage's last backward (runtime/overlap_grad.py) instead of after the schedule
    overlap_grad_reduce: bool = False
    # Megatron's --overlap-param-gather (with the plan's use_distributed_optimizer): the updated
    # parameters' all-gather runs while the next forward starts (optim/distributed.py)
    overlap_param_gather: bool = False
    # Megatron's --ddp-bucket-size: parameters per gradient bucket with overlap_grad_reduce; None:
    # megatron-core's default max(40M, 1M x replicas). Without overlap a bucket is one holder group
    ddp_bucket_size: int | None = None
    # Megatron's --distributed-timeout-minutes: timeout of every process group of the run (a hung peer
    # fails the collective after this long instead of blocking forever); fractions bound tests tighter
    distributed_timeout_minutes: float = 10
    # Mixed precision as Megatron-LM does it: parameters and activations in bf16 (--bf16) or fp16
    # (--fp16), fp32 main parameters in the optimizer, gradients accumulated and reduced in fp32
    bf16: bool = False
    fp16: bool = False
    # fp16 loss scaling (Megatron's flags): a constant --loss-scale, or when None a dynamic scale
    # starting at initial_loss_scale, halved on overflow after `hysteresis` overflows, doubled after
    # loss_scale_window clean steps, never below min_loss_scale
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    # Megatron's --accumulate-allreduce-grads-in-fp32 (forced on with --bf16 there); this runtime
    # always accumulates and reduces gradients in fp32 main-gradient buffers, so the flag is accepted
    accumulate_allreduce_grads_in_fp32: bool = False
    # Megatron's --transformer-impl: "transformer_engine" or "local"; None: transformer-engine's layer
    # spec where it is importable on a GPU, else megatron-core's local spec (model/gpt.py)
    transformer_impl: str | None = None
    # Megatron's --deterministic-mode: torch's deterministic algorithms, the libraries' deterministic
    # settings and megatron-core's deterministic_mode (platform/determinism.py)
    deterministic_mode: bool = False

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "global_batch_size", "train_iters", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"global_batch_size {self.global_batch_size} is not a multiple of "
                             f"micro_batch_size {self.micro_batch_size}; choose sizes that divide")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"lr_decay_style must be one of {', '.join(LR_DECAY_STYLES)}, got {self.lr_decay_style!r}")
        self._check_schedule()
        if self.tp_comm_overlap_chunks < 1:
            raise ValueError(f"tp_comm_overlap_chunks must be >= 1, got {self.tp_comm_overlap_chunks} (limit 1). "
                             f"Fix: use 1 for Megatron's unchunked path or e.g. 4")
        if self.ddp_bucket_size is not None and self.ddp_bucket_size < 1:
            raise ValueError(f"ddp_bucket_size must be >= 1 parameter or None, got {self.ddp_bucket_size} "
                             f"(limit 1). Fix: leave it None for megatron-core's default")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0, got {self.clip_grad}")
        if self.transformer_impl not in (None, "local", "transformer_engine"):
            raise ValueError(f"transformer_impl must be local or transformer_engine, got {self.transformer_impl!r}. "
                             "Fix: pass --transformer-impl local (CPU) or transformer_engine (GPU with TE)")
        if self.bf16 and self.fp16:
            raise ValueError("bf16 and fp16: choose one precision (got both). Fix: pass --bf16 or --fp16")
        if self.loss_scale is not None and not self.loss_scale > 0:
            raise ValueError(f"loss_scale must be > 0 or None (dynamic), got {self.loss_scale}. "
                             "Fix: omit --loss-scale for dynamic loss scaling")
        if not (self.initial_loss_scale > 0 and 0 < self.min_loss_scale <= self.initial_loss_scale):
            raise ValueError(f"initial_loss_scale {self.initial_loss_scale} / min_loss_scale {self.min_loss_scale}: "
                             "need 0 < min <= initial. Fix: e.g. --initial-loss-scale 4294967296 --min-loss-scale 1")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ValueError(f"loss_scale_window {self.loss_scale_window} and hysteresis {self.hysteresis} must be "
                             ">= 1. Fix: Megatron's defaults are 1000 and 2")
        if not self.distributed_timeout_minutes > 0:
            raise ValueError(f"distributed_timeout_minutes must be > 0, got {self.distributed_timeout_minutes}. "
                             f"Fix: pass minutes, e.g. --distributed-timeout-minutes 10")

    @property
    def precision(self) -> str:
        """"bf16", "fp16" or "fp32": the parameters' and activations' precision (Plan.precision's names)."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    @property
    def group_timeout(self) -> datetime.timedelta:
        """The one timeout every process group of the run is created with."""
        return datetime.timedelta(minutes=self.distributed_timeout_minutes)

    def _check_schedule(self) -> None:
        """Megatron's scheduler asserts these; say which flag and both numbers instead."""
        if not 0 <= self.min_lr <= self.lr or not 0 <= self.lr_warmup_init <= self.lr:
            raise ValueError(f"--min-lr {self.min_lr} and --lr-warmup-init {self.lr_warmup_init} must lie in [0, --lr "
                             f"{self.lr}]. Fix: lower them or raise --lr")
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise ValueError(f"--decoupled-min-lr {self.decoupled_min_lr} needs --decoupled-lr (it is the floor of "
                             "that rate). Fix: add --decoupled-lr, or drop --decoupled-min-lr")
        if self.lr_wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(f"lr_wsd_decay_style must be one of {', '.join(WSD_DECAY_STYLES)}, got "
                             f"{self.lr_wsd_decay_style!r}")
        steps = self.schedule_steps()
        if self.lr_decay_style == "WSD" and steps["wsd_decay_steps"] is None:
            raise ValueError("--lr-decay-style WSD needs the anneal length. Fix: add --lr-wsd-decay-iters N "
                             "(or --lr-wsd-decay-samples with --train-samples)")
        if not 0 <= steps["lr_warmup_steps"] < steps["lr_decay_steps"]:
            raise ValueError(f"the warm-up ({steps['lr_warmup_steps']:g} samples) must be shorter than the decay "
                             f"({steps['lr_decay_steps']:g} samples). Fix: shorten --lr-warmup-iters/-fraction or "
                             f"lengthen --lr-decay-iters")

    def schedule_steps(self) -> dict[str, float | int | None]:
        """Megatron-LM's step counts (samples) of the learning-rate schedule, as its
        ``get_optimizer_param_scheduler`` computes them: decay, warm-up, WSD anneal."""
        gbs = self.global_batch_size
        if self.train_samples is None:  # iteration-based training
            decay = (self.lr_decay_iters if self.lr_decay_iters is not None else self.train_iters) * gbs
            wsd = self.lr_wsd_decay_iters * gbs if self.lr_wsd_decay_iters is not None else None
            warmup = self.lr_warmup_iters * gbs
        else:  # sample-based training
            decay = self.lr_decay_samples if self.lr_decay_samples is not None else self.train_samples
            wsd = self.lr_wsd_decay_samples
            warmup = self.lr_warmup_samples
        if self.lr_warmup_fraction is not None:
            warmup = self.lr_warmup_fraction * decay
        return {"lr_decay_steps": decay, "lr_warmup_steps": warmup, "wsd_decay_steps": wsd}


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """What a pretraining run does around the steps (Megatron-LM's flags of the same names)."""

    eval_interval: int = 0  # iterations between validation passes; 0: none
    eval_iters: int = 0  # validation batches per pass
    save: str | None = None  # checkpoint directory written at the end (and every save_interval)
    save_interval: int = 0  # iterations between intermediate saves; 0: only at the end
    # --save-retain-interval: checkpoints at multiples of it are kept, the others deleted once a newer
    # one is written (the latest always stays); 0: keep every checkpoint
    save_retain_interval: int = 0
    load: str | None = None  # checkpoint directory to resume from (its latest iteration)
    finetune: bool = False  # --finetune: load the weights only; iteration 0, fresh optimizer, data from the start
    no_load_optim: bool = False  # --no-load-optim: resume without the optimizer state (fresh moments)
    # iterations between checks that every holder of a parameter holds the same value (Megatron-LM's
    # --check-weight-hash-across-dp-replicas-interval, here over every holder: replicas of any layout,
    # TP peers of replicated parameters, tied copies); also checked before the first step; 0: never
    check_weight_hash_interval: int = 0
    # end the run early, saving first when --save is given (Megatron-LM's flags of the same names; 0: never):
    exit_interval: int = 0  # after the first iteration divisible by this
    exit_duration_in_mins: float = 0  # after the first iteration that ends this many minutes into training
    # Megatron-LM's --profile and its companions (train/profiler.py)
    profile: bool = False  # capture iterations [profile_step_start, profile_step_end)
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: tuple[int, ...] = ()  # empty: every rank
    use_pytorch_profiler: bool = False  # torch's profiler (else nsys's capture range, GPUs only)
    pytorch_profiler_collect_shapes: bool = False
    pytorch_profiler_collect_callstack: bool = False
    profile_trace_dir: str | None = None  # torch profiler traces: <--tensorboard-dir>/../torch_profile

    def profile_config(self):
        """The ProfileConfig of --profile (None without it); ValueError on a bad window."""
        if not self.profile:
            return None
        from megatron_het.train.profiler import ProfileConfig

        return ProfileConfig(step_start=self.profile_step_start, step_end=self.profile_step_end,
                             ranks=tuple(self.profile_ranks), pytorch_profiler=self.use_pytorch_profiler,
                             trace_dir=self.profile_trace_dir, collect_shapes=self.pytorch_profiler_collect_shapes,
                             collect_callstack=self.pytorch_profiler_collect_callstack)

    def __post_init__(self) -> None:
        if self.save_retain_interval and (not self.save_interval or self.save_retain_interval % self.save_interval):
            raise ValueError(f"--save-retain-interval {self.save_retain_interval} must be a multiple of "
                             f"--save-interval {self.save_interval} (as Megatron-LM asserts). Fix: pick a multiple")
        for name in ("eval_interval", "eval_iters", "save_interval", "check_weight_hash_interval", "exit_interval",
                     "exit_duration_in_mins", "save_retain_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the training tokens come from."""

    mock_data: bool = False  # synthetic tokens instead of data_path
    data_path: tuple[str, ...] = ()  # indexed dataset prefix (or weight prefix ... pairs)
    split: str = "949,50,1"  # train,valid,test weights
    data_cache_path: str | None = None  # where megatron-core caches dataset indices
    tokenizer_type: str = "SentencePieceTokenizer"  # Megatron-LM's --tokenizer-type (data/tokenizer.py)
    tokenizer_model: str | None = None  # SentencePiece model file or HuggingFace tokenizer directory
    vocab_file: str | None = None  # GPT2BPETokenizer's vocab.json
    merge_file: str | None = None  # GPT2BPETokenizer's merges.txt
    # --vocab-size as Megatron-LM hands it to the tokenizer: NullTokenizer's ids are below it, TikTokenizer's
    # vocabulary (special tokens included; None: tiktoken's 131072)
    tokenizer_vocab_size: int | None = None


@dataclass(frozen=True, kw_only=True)
class TensorBoardConfig:
    """Megatron-LM's TensorBoard flags, validated (``runtime/tensorboard_log.py`` writes the scalars)."""

    log_dir: str  # --tensorboard-dir: where the event files go
    log_interval: int = 1  # --tensorboard-log-interval: iterations between written points
    queue_size: int = 1000  # --tensorboard-queue-size: events buffered before a write to disk
    log_timers: bool = False  # --log-timers-to-tensorboard: iteration-time and per-stage compute/idle
    log_memory: bool = False  # --log-memory-to-tensorboard: peak/current memory, per stage
    log_throughput: bool = False  # --log-throughput: tokens/s and samples/s
    # Weights & Biases: the same scalars, mirrored by the writing rank (Megatron-LM logs W&B beside its
    # TensorBoard writer); wandb_project None: off
    wandb_project: str | None = None  # --wandb-project
    wandb_exp_name: str = ""  # --wandb-exp-name: the run's name (required with a project, as Megatron)
    wandb_save_dir: str | None = None  # --wandb-save-dir (pretrain_gpt.py: default <--save>/wandb)
    wandb_entity: str | None = None  # --wandb-entity: the team or user

    def __post_init__(self) -> None:
        if not self.log_dir:
            raise ValueError("--tensorboard-dir: got ''. Fix: pass a directory, e.g. --tensorboard-dir runs/tb")
        if self.wandb_project and not self.wandb_exp_name:
            raise ValueError(f"--wandb-project {self.wandb_project}: the run needs a name, as in Megatron-LM. Fix: add "
                             "--wandb-exp-name NAME")
        if self.wandb_project and not self.wandb_save_dir:
            raise ValueError(f"--wandb-project {self.wandb_project}: W&B writes its files under --wandb-save-dir "
                             "(default <--save>/wandb). Fix: add --wandb-save-dir DIR or --save DIR")
        for flag, value in (("--tensorboard-log-interval", self.log_interval),
                            ("--tensorboard-queue-size", self.queue_size)):
            if value < 1:
                raise ValueError(f"{flag}: got {value}, the minimum is 1. Fix: pass {flag} 1 or more")
