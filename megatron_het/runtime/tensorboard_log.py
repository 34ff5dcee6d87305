"""TensorBoard logging of a pretrain run: Megatron-LM's flags and scalar names, per-stage times.

One rank writes: global rank 0 of the run (it also prints the log lines; the loss is all-reduced,
so every rank knows it). Per-stage times and memory come from every rank: at each logged iteration
the ranks send their (replica, stage, compute, idle, peak memory) to the writer, which logs the mean
over each stage's ranks. Scalars (step = iteration, 1-based as in Megatron-LM):

- always: ``lm loss``, ``learning-rate``, ``grad-norm``, ``batch-size``, ``lm loss validation``; an
  MoE model's router losses under megatron-core's names (``load_balancing_loss``, ``z_loss``:
  runtime/moe_metrics.py)
- ``--log-timers-to-tensorboard``: ``iteration-time`` (s) and per stage
  ``stage-time/<replica>.<stage>/compute`` and ``.../idle`` (s, this iteration)
- ``--log-throughput``: ``throughput/tokens-per-s``, ``throughput/samples-per-s`` (global batch / iteration-time)
- ``--log-memory-to-tensorboard``: ``mem-max-allocated-bytes`` and ``mem-allocated-bytes`` (max over
  ranks) and ``mem-max-allocated-bytes/<replica>.<stage>``. On CPU ranks these are the process's
  peak resident set size (``resource.getrusage``) and current RSS (psutil), not allocator figures.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from megatron_het.errors import UserError
from megatron_het.train.config import TensorBoardConfig
from megatron_het.train.lr_schedule import lr_at
from megatron_het.train.strategy import IterationLog
from megatron_het.train.trainer import Trainer, TrainerHooks

if TYPE_CHECKING:
    from megatron_het.plan.layout import RankRole

__all__ = ["StageTime", "TensorBoardConfig", "TensorBoardHooks", "TensorBoardUnavailable", "gather_stage_times",
           "iteration_scalars", "require_tensorboard", "stage_scalars", "stage_times"]

INSTALL_HINT = "pip install tensorboard  (or: pip install -e '.[tensorboard]')"


class TensorBoardUnavailable(UserError):
    """--tensorboard-dir was given but the ``tensorboard`` package is not importable (a usage error)."""


def require_tensorboard() -> None:
    """Raise TensorBoardUnavailable (naming the package and the install command) if it is missing."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as e:
        raise TensorBoardUnavailable(
            f"--tensorboard-dir: the `tensorboard` package is not importable ({e}). Fix: {INSTALL_HINT}, "
            f"or drop --tensorboard-dir") from e


class WandbUnavailable(UserError):
    """--wandb-project was given and wandb does not import."""


def require_wandb() -> None:
    """wandb must import where --wandb-project is given (it is not a dependency of megatron-het)."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise WandbUnavailable("--wandb-project: wandb is not installed in this environment. Fix: pip install "
                               "wandb (and wandb login, or WANDB_MODE=offline), or drop --wandb-project") from None


class WandbMirror:
    """The TensorBoard writer's scalars, logged to a W&B run as Megatron-LM's wandb writer logs them."""

    def __init__(self, config: TensorBoardConfig, run_config: dict) -> None:
        import wandb

        os.makedirs(config.wandb_save_dir, exist_ok=True)
        kwargs = {"dir": config.wandb_save_dir, "name": config.wandb_exp_name, "project": config.wandb_project,
                  "config": run_config}
        if config.wandb_entity:
            kwargs["entity"] = config.wandb_entity
        self.run = wandb.init(**kwargs)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.run.log({tag: value}, step=step)

    def flush(self) -> None:
        pass  # wandb sends in the background

    def close(self) -> None:
        self.run.finish()


@dataclass(frozen=True, kw_only=True)
class StageTime:
    """Where one stage's time went, averaged over its ranks (also the end-of-run summary's rows)."""

    replica: int  # replica index in the plan
    stage: int  # stage index in the replica
    island: str  # island the stage runs on
    compute_s: float  # forward+backward compute over the sampled iterations, mean over the stage's ranks
    idle_s: float  # the rest of those iterations (waiting for neighbours, collectives), mean over ranks
    iterations: int  # iterations summed in compute_s / idle_s
    peak_memory_bytes: int  # max over the stage's ranks of peak_memory_bytes()
    memory_bytes: int  # max over the stage's ranks of current_memory_bytes() when sampled

    @property
    def key(self) -> str:
        return f"{self.replica}.{self.stage}"


def peak_memory_bytes() -> int:
    """This process's peak resident set size (CPU ranks: the OS figure, not an allocator's)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB, macOS bytes


def current_memory_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def stage_times(samples: Sequence[tuple]) -> list[StageTime]:
    """Per-rank samples (replica, stage, island, compute_s, idle_s, iterations, peak bytes, current bytes)
    -> one StageTime per stage, in (replica, stage) order."""
    by_stage: dict[tuple[int, int, str], list[tuple]] = {}
    for replica, stage, island, *rest in samples:
        by_stage.setdefault((replica, stage, island), []).append(tuple(rest))
    return [StageTime(replica=r, stage=s, island=i, compute_s=sum(v[0] for v in vals) / len(vals),
                      idle_s=sum(v[1] for v in vals) / len(vals), iterations=vals[0][2],
                      peak_memory_bytes=max(v[3] for v in vals), memory_bytes=max(v[4] for v in vals))
            for (r, s, i), vals in sorted(by_stage.items())]


def gather_stage_times(role: RankRole, logs: Sequence[IterationLog], *, group: dist.ProcessGroup | None,
                       dst: int, accelerator=None) -> list[StageTime] | None:
    """Collective over ``group``: every rank's compute/idle over ``logs``; the stages on global rank ``dst``, else None.

    Memory: the ``accelerator``'s figures (GPU: torch's max_memory_allocated / memory_allocated of the
    rank's device; CPU: resident set size), or the process RSS without one."""
    if accelerator is not None and accelerator.is_gpu:
        stats = accelerator.memory()
        peak, current = stats.max_allocated, stats.current
    else:
        current = current_memory_bytes()  # first: the OS peak may lag a sample taken after it
        peak = max(peak_memory_bytes(), current)
    mine = (role.replica, role.stage, role.island, sum(l.compute_s for l in logs), sum(l.idle_s for l in logs),
            len(logs), peak, current)
    me = dist.get_rank()
    gathered = [None] * dist.get_world_size(group) if me == dst else None
    dist.gather_object(mine, gathered, dst=dst, group=group)
    return stage_times(gathered) if me == dst else None


def iteration_scalars(log: IterationLog, *, lr: float, global_batch_size: int, seq_length: int,
                      config: TensorBoardConfig) -> dict[str, float]:
    """The per-iteration scalars of one logged iteration (pure)."""
    out = {"lm loss": log.lm_loss, "learning-rate": lr, "grad-norm": log.grad_norm,
           "batch-size": float(global_batch_size)}
    for tag, value in (("params-norm", log.params_norm), ("num-zeros", log.num_zeros)):  # --log-params-norm & co.
        if value is not None:
            out[tag] = value
    out.update(log.moe_losses)  # MoE: the routers' losses, as megatron-core's tracker writes them
    if config.log_timers:
        out["iteration-time"] = log.elapsed_s
    if config.log_throughput:
        out["throughput/tokens-per-s"] = global_batch_size * seq_length / log.elapsed_s
        out["throughput/samples-per-s"] = global_batch_size / log.elapsed_s
    return out


def stage_scalars(stages: Sequence[StageTime], *, config: TensorBoardConfig) -> dict[str, float]:
    """Per-stage scalars (means per iteration) and the memory maxima (pure)."""
    out: dict[str, float] = {}
    for st in stages:
        if config.log_timers:
            out[f"stage-time/{st.key}/compute"] = st.compute_s / st.iterations
            out[f"stage-time/{st.key}/idle"] = st.idle_s / st.iterations
        if config.log_memory:
            out[f"mem-max-allocated-bytes/{st.key}"] = float(st.peak_memory_bytes)
    if config.log_memory and stages:
        out["mem-max-allocated-bytes"] = float(max(st.peak_memory_bytes for st in stages))
        out["mem-allocated-bytes"] = float(max(st.memory_bytes for st in stages))
    return out


class TensorBoardHooks(TrainerHooks):
    """Writes the scalars above from ``on_step_end``; construct on every rank (the gather is collective).

    Close it (or use it as a context manager) so the event file is flushed, also when training fails.
    """

    def __init__(self, config: TensorBoardConfig, *, group: dist.ProcessGroup | None, global_batch_size: int,
                 seq_length: int, writer_rank: int = 0, run_config: dict | None = None) -> None:
        self.config = config
        self.group = group  # the ranks of the run (the per-stage gather spans it)
        self.global_batch_size, self.seq_length = global_batch_size, seq_length
        self.writer_rank = writer_rank  # global rank that writes the event file
        self.writers: list = []  # the writing rank's: the event file, and W&B with --wandb-project
        if dist.get_rank() == writer_rank:
            require_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            self.writers.append(SummaryWriter(log_dir=config.log_dir, max_queue=config.queue_size))
            if config.wandb_project:
                self.writers.append(WandbMirror(config, run_config or {}))

    def __enter__(self) -> TensorBoardHooks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def on_step_end(self, trainer: Trainer, log: IterationLog) -> None:
        if log.iteration % self.config.log_interval:
            return
        stages = None
        if self.config.log_timers or self.config.log_memory:
            stages = gather_stage_times(trainer.strategy.role, [log], group=self.group, dst=self.writer_rank,
                                        accelerator=getattr(trainer.strategy, "accelerator", None))
        if not self.writers:
            return
        scalars = iteration_scalars(log, lr=lr_at(trainer.train, log.iteration - 1),
                                    global_batch_size=self.global_batch_size, seq_length=self.seq_length,
                                    config=self.config)
        if stages is not None:
            scalars.update(stage_scalars(stages, config=self.config))
        for writer in self.writers:
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, log.iteration)

    def log_validation(self, iteration: int, loss: float) -> None:
        """Validation loss at ``iteration`` (call on every rank; the writer writes)."""
        for writer in self.writers:
            writer.add_scalar("lm loss validation", loss, iteration)

    def close(self) -> None:
        for writer in self.writers:
            writer.flush()
            writer.close()
        self.writers = []
