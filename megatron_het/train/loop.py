"""Megatron's pretraining loop around the trainer: log lines, evaluation, periodic saves, summary.

The same for every plan kind: ``cli/pretrain.py`` builds the trainer (pipeline or sharded
strategy) and hands it here. Log lines come from global rank 0 in Megatron-LM's format.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_het.train.config import LoopConfig
from megatron_het.train.lr_schedule import lr_at
from megatron_het.train.strategy import BatchFn, IterationLog
from megatron_het.train.trainer import Trainer


def print_rank0(msg: str) -> None:
    """Print on global rank 0 (before the process group exists: the launcher's RANK, if any)."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(msg, flush=True)


def iteration_line(*, iteration: int, train_iters: int, global_batch_size: int, elapsed_s: float, lr: float,
                   loss: float, grad_norm: float, tokens_per_s: float, loss_scale: float | None = None,
                   skipped: int | None = None, consumed_samples: int | None = None,
                   num_zeros: float | None = None, params_norm: float | None = None,
                   moe_losses: Mapping[str, float] | None = None) -> str:
    """Megatron-LM's per-iteration log line (``elapsed_s``: mean per iteration over the log window);
    with fp16 loss scaling also the scale and the skipped iterations of the window, as Megatron.
    ``consumed_samples``: the run's data position (train/data_position.py; None: a fresh run's
    ``iteration * global_batch_size``)."""
    if consumed_samples is None:
        consumed_samples = iteration * global_batch_size
    line = (f" iteration {iteration:8d}/{train_iters:8d} | consumed samples: {consumed_samples:10d} "
            f"| elapsed time per iteration (ms): {elapsed_s * 1000:.1f} | learning rate: {lr:.3E} "
            f"| global batch size: {global_batch_size:5d} | lm loss: {loss:.6E} ")
    for name, value in (moe_losses or {}).items():  # MoE: the routers' losses, as Megatron-LM logs them
        line += f"| {name}: {value:.6E} "
    if loss_scale is not None:
        line += f"| loss scale: {loss_scale:.1f} "
    line += f"| grad norm: {grad_norm:.3f} "
    if num_zeros is not None:  # --log-num-zeros-in-grad
        line += f"| num zeros: {int(num_zeros)} "
    if params_norm is not None:  # --log-params-norm
        line += f"| params norm: {params_norm:.3f} "
    line += f"| tokens/s: {tokens_per_s:.0f}"
    if skipped is not None:
        line += f" | number of skipped iterations: {skipped:3d}"
    return line


def memory_line(rank: int, iteration: int, memory) -> str:
    """Megatron-LM's memory report of one rank (``platform.MemoryStats``; CPU: resident set size)."""
    mib = 1 << 20
    return (f"[Rank {rank}] (after {iteration} iterations) memory (MB) | allocated: {memory.current / mib:.1f} "
            f"| max allocated: {memory.max_allocated / mib:.1f} | max reserved: {memory.max_reserved / mib:.1f}")


@dataclass(frozen=True, kw_only=True)
class PretrainResult:
    """What one rank saw of a run (losses are global: every rank holds the same values)."""

    logs: tuple[IterationLog, ...]  # one per iteration trained in this run
    validation: tuple[tuple[int, float], ...]  # (iteration, validation loss) at each eval_interval


def check_weights(trainer: Trainer, when: str) -> None:
    """Every holder of each parameter holds the same value (collective; raises on every rank if not)."""
    cells = trainer.strategy.check_weights(f"weight check {when}: ")
    print_rank0(f"weight check {when}: every holder agrees ({cells} parameter cells compared)")


def train_loop(trainer: Trainer, *, loop: LoopConfig, seq_length: int, valid_fn: BatchFn | None,
               on_validation: Callable[[int, float], None] | None = None,
               tokenizer_model: str | None = None, started_at: float | None = None) -> PretrainResult:
    """Train up to ``trainer.train.train_iters`` (from the trainer's iteration); collective.

    Checkpoints carry ``tokenizer_model`` (the run's SentencePiece file) when given.
    ``started_at``: the process's start (``time.perf_counter()``), from which --exit-duration-in-mins
    counts, as Megatron-LM's (None: this call's start).
    """
    train = trainer.train
    validation = []
    window_start = time.perf_counter()
    skipped = 0  # fp16: steps skipped on overflow in the current log window
    memory_reported = False

    def after_step(entry: IterationLog) -> bool:
        """Log, validate, check, save; True to end the run here (--exit-interval/-duration-in-mins)."""
        nonlocal window_start, skipped, memory_reported, exit_reason
        it = entry.iteration
        skipped += int(entry.skipped)
        if it % train.log_interval == 0:
            elapsed = (time.perf_counter() - window_start) / train.log_interval
            window_start = time.perf_counter()
            print_rank0(iteration_line(iteration=it, train_iters=train.train_iters,
                                       global_batch_size=train.global_batch_size, elapsed_s=elapsed,
                                       lr=lr_at(train, it - 1), loss=entry.lm_loss, grad_norm=entry.grad_norm,
                                       tokens_per_s=train.global_batch_size * seq_length / elapsed,
                                       loss_scale=entry.loss_scale,
                                       skipped=skipped if entry.loss_scale is not None else None,
                                       consumed_samples=entry.consumed_samples, num_zeros=entry.num_zeros,
                                       params_norm=entry.params_norm, moe_losses=entry.moe_losses))
            skipped = 0
            if not memory_reported and entry.memory is not None:  # once, every rank's line, as Megatron
                gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
                dist.gather_object(entry.memory, gathered, dst=0)  # collective: every rank logs this iteration
                for rank, memory in enumerate(gathered or ()):
                    print_rank0(memory_line(rank, it, memory))
                memory_reported = True
        if loop.eval_interval and loop.eval_iters and valid_fn is not None and it % loop.eval_interval == 0:
            validate(it)
        if loop.check_weight_hash_interval and it % loop.check_weight_hash_interval == 0:
            check_weights(trainer, f"after iteration {it}")
        if profiler is not None:
            profiler.after(it)
            profiler.before(it)  # the next iteration's
        exit_reason = exit_now(it)
        if exit_reason is not None:
            return True  # the end-of-run save below writes this iteration's checkpoint
        if loop.save and loop.save_interval and it % loop.save_interval == 0 and it < train.train_iters:
            save()
        return False

    def exit_now(it: int) -> str | None:
        """Megatron-LM's exit checks after iteration ``it``: the interval, then the wall time (a world
        MAX of every rank's verdict, so all ranks stop at the same iteration)."""
        if loop.exit_interval and it % loop.exit_interval == 0:
            return f"exiting program at iteration {it} (--exit-interval {loop.exit_interval})"
        if loop.exit_duration_in_mins:
            minutes = (time.perf_counter() - train_start) / 60
            done = torch.tensor([float(minutes > loop.exit_duration_in_mins)])
            dist.all_reduce(done, op=dist.ReduceOp.MAX)  # host tensor: the world group is gloo-capable
            if done.item():
                return (f"exiting program after {minutes:.2f} minutes at iteration {it} "
                        f"(--exit-duration-in-mins {loop.exit_duration_in_mins:g})")
        return None

    def save() -> None:
        """Write this iteration's checkpoint; with --save-retain-interval, then delete the one it
        replaces as the latest unless its iteration is a multiple of the interval (Megatron-LM's rule).
        Rank 0 alone reads the tracker and deletes, and every rank meets at one barrier after."""
        from megatron_het.checkpoint.dist_ckpt import iteration_dir, latest_iteration

        retain = loop.save_retain_interval
        previous = latest_iteration(loop.save) if retain and dist.get_rank() == 0 else None
        print_rank0(f"saved checkpoint {trainer.save_checkpoint(loop.save, tokenizer_model=tokenizer_model)}")
        if not retain:
            return
        if previous and previous != trainer.iteration and previous % retain:
            old = iteration_dir(loop.save, previous)
            if os.path.isdir(old) and not os.path.islink(old):
                shutil.rmtree(old)
                print(f"deleted checkpoint {old} (--save-retain-interval {retain})", flush=True)
        dist.barrier()

    def validate(it: int) -> None:
        loss = sum(trainer.evaluate(valid_fn, i) for i in range(loop.eval_iters)) / loop.eval_iters
        validation.append((it, loss))
        if on_validation is not None:
            on_validation(it, loss)
        print_rank0(f" validation loss at iteration {it} | lm loss value: {loss:.6E} | "
                    f"lm loss PPL: {math.exp(min(loss, 700.0)):.3f}")

    if loop.check_weight_hash_interval:
        check_weights(trainer, "at start" if trainer.iteration == 0 else f"after loading iteration {trainer.iteration}")
    if trainer.iteration > 0:  # resumed: the data continues where the checkpoint's run stopped
        print_rank0(f"resuming data at consumed samples {trainer.consumed_samples} (iteration {trainer.iteration}, "
                    f"global batch size {train.global_batch_size})")
    profiler = None
    if loop.profile:
        from megatron_het.platform import detect_accelerator
        from megatron_het.train.profiler import StepProfiler

        profiler = StepProfiler(loop.profile_config(), rank=dist.get_rank(), is_gpu=detect_accelerator().is_gpu)
        profiler.before(trainer.iteration)
    train_start = time.perf_counter() if started_at is None else started_at
    exit_reason: str | None = None
    try:
        logs = trainer.run(max(0, train.train_iters - trainer.iteration), on_iteration=after_step).iterations
    finally:
        if profiler is not None:
            profiler.close()  # a window the run ended inside of
    if exit_reason is not None:
        print_rank0(exit_reason)
    # Megatron-LM validates once more at the end of training (--eval-iters > 0 and a validation split);
    # skipped when the last iteration was just validated (the same numbers), and on an early exit (as Megatron)
    elif loop.eval_iters and valid_fn is not None and (not validation or validation[-1][0] != trainer.iteration):
        validate(trainer.iteration)
    if loop.save:
        save()
    if logs:
        for line in trainer.strategy.summary_lines(logs):
            print(line, flush=True)
    return PretrainResult(logs=tuple(logs), validation=tuple(validation))
