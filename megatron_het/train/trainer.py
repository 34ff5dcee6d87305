"""The one training loop: iteration counter, hooks, timer, logs, evaluation and checkpoints; and the
hook points (``TrainerHooks``, ``ChainedHooks``) through which logging and fault tolerance plug in.

Every run goes through ``Trainer``: pipeline plans, sharded plans, the plain megatron-core
baseline and resilient runs alike. What differs between them is the strategy it drives
(``train/strategy.py``); what a run does around the steps (Megatron's log lines, evaluation and
periodic saves) is ``train/loop.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from megatron_het.train.config import TrainConfig
from megatron_het.train.data_position import check_resumed_data, consumed_samples
from megatron_het.train.lr_schedule import lr_at
from megatron_het.train.readout import Readout, read_all
from megatron_het.train.strategy import MOE_KEY, BatchFn, IterationLog, RunResult, Strategy
from megatron_het.train.timer import EmulationTimer


class TrainerHooks:
    """Optional hook points of the trainer (defaults do nothing).

    ``on_action`` sees each schedule action before it runs (strategies with schedules call it);
    ``on_failure`` may repair the trainer after an exception of an iteration (e.g. rebind its
    strategy to new groups, or replace the strategy) and return True to redo that iteration.
    """

    def on_step_start(self, trainer: Trainer, iteration: int) -> None:
        return None

    def on_action(self, trainer: Trainer, iteration: int, index: int, action) -> None:
        return None

    def on_step_end(self, trainer: Trainer, log: IterationLog) -> None:
        return None

    def on_failure(self, trainer: Trainer, iteration: int, error: BaseException) -> bool:
        return False


class ChainedHooks(TrainerHooks):
    """Several hooks as one (e.g. TensorBoard logging and fault tolerance): every hook sees every
    event in order; a failure is repaired as soon as one hook repairs it."""

    def __init__(self, *hooks: TrainerHooks) -> None:
        self.hooks = tuple(hooks)  # called in this order

    def on_step_start(self, trainer: Trainer, iteration: int) -> None:
        for h in self.hooks:
            h.on_step_start(trainer, iteration)

    def on_action(self, trainer: Trainer, iteration: int, index: int, action) -> None:
        for h in self.hooks:
            h.on_action(trainer, iteration, index, action)

    def on_step_end(self, trainer: Trainer, log: IterationLog) -> None:
        for h in self.hooks:
            h.on_step_end(trainer, log)

    def on_failure(self, trainer: Trainer, iteration: int, error: BaseException) -> bool:
        return any(h.on_failure(trainer, iteration, error) for h in self.hooks)


class Trainer:
    """Trains ``strategy`` with ``train``'s schedule of learning rates. Construct on every rank."""

    def __init__(self, *, strategy: Strategy, train: TrainConfig, hooks: TrainerHooks | None = None,
                 timer: EmulationTimer | None = None) -> None:
        self.strategy = strategy  # the parallelism strategy of this rank (replaceable on a re-plan)
        self.train = train
        self.hooks = hooks or TrainerHooks()  # the defaults do nothing: an exception ends the run
        self.timer = timer or EmulationTimer()  # compute measurement and device emulation of this rank
        self.iteration = 0  # optimizer steps taken (= the next 0-based iteration)
        self._unread: list[Readout] = []  # device values of the current log window, not read yet

    def read_logs(self) -> None:
        """Read every log value still on the device (one host transfer): done at each log interval,
        before the hooks see that iteration, and at the end of ``run``."""
        read_all(self._unread)
        self._unread = []

    def train_step(self) -> IterationLog:
        """One iteration; on an exception the hooks may repair the trainer and the iteration is redone."""
        while True:
            it = self.iteration
            self.hooks.on_step_start(self, it)
            try:
                log = self._step(it)
            except Exception as error:  # a peer failed: the hooks may repair the groups and redo
                if not self.hooks.on_failure(self, it, error):
                    raise
                continue
            self._unread.append(log.readout)
            if self.iteration % self.train.log_interval == 0:
                self.read_logs()  # as Megatron: losses are read once per --log-interval
            self.hooks.on_step_end(self, log)
            return log

    def _step(self, it: int) -> IterationLog:
        start = time.perf_counter()
        self.timer.reset()
        result = self.strategy.step(it, lr=lr_at(self.train, it), timer=self.timer,
                                    on_action=lambda index, action: self.hooks.on_action(self, it, index, action))
        elapsed = time.perf_counter() - start
        self.iteration = it + 1
        tokens = self.train.global_batch_size * self.strategy.model_spec.seq_length
        moe = {f"{MOE_KEY}{name}": value for name, value in (result.moe_losses or {}).items()}
        readout = Readout(lm_loss=result.lm_loss, grad_norm=result.grad_norm, loss_scale=result.loss_scale,
                          params_norm=result.params_norm, num_zeros=result.num_zeros, **moe)
        consumed = consumed_samples(self.strategy, self.iteration, self.train.global_batch_size)
        return IterationLog(iteration=self.iteration, consumed_samples=consumed, readout=readout, elapsed_s=elapsed,
                            compute_s=self.timer.compute_s, emulated_s=self.timer.emulated_s, comm_s=result.comm_s, optimizer_s=result.optimizer_s, tokens_per_s=tokens / elapsed,
                            skipped=result.skipped, memory=self._memory())

    def _memory(self):
        acc = getattr(self.strategy, "accelerator", None)
        return acc.memory() if acc is not None else None

    def use_strategy(self, strategy: Strategy, *, iteration: int) -> None:
        """Continue with another strategy (a re-plan) from ``iteration``; a checkpoint load may follow.
        The data position (a resumed run's consumed samples) carries over to the new strategy."""
        position = getattr(self.strategy, "data_position", None)
        if position is not None and hasattr(strategy, "data_position"):
            strategy.data_position = position
        self.strategy, self.iteration = strategy, iteration

    def run(self, iterations: int | None = None, *, return_shards: bool = False,
            on_iteration: Callable[[IterationLog], None] | None = None) -> RunResult:
        """Train until ``iterations`` more steps are done (default ``train.train_iters``) counted from
        the current iteration, also when a re-plan rewinds to an older checkpoint; the logs, and with
        ``return_shards`` the parameters before and after (on ranks whose strategy reports them).

        Losses and norms stay on the device and are read once per ``train.log_interval`` (and at the
        end), as Megatron does: ``on_iteration`` sees every log, with its values read on the
        log-interval iterations (reading one earlier reads it alone); ``on_iteration`` returning True
        ends the run after that iteration (Megatron's --exit-interval / --exit-duration-in-mins)."""
        initial = self.shards() if return_shards else None
        target = self.iteration + (iterations if iterations is not None else self.train.train_iters)
        logs = []
        while self.iteration < target:
            log = self.train_step()
            logs.append(log)
            if self.iteration >= target:
                self.read_logs()  # the last window's values
            if on_iteration is not None and on_iteration(log):
                self.read_logs()  # the cut window's values
                break
        final = self.shards() if return_shards else None
        keep = return_shards and self.strategy.reports_shards
        return RunResult(rank=self.strategy.rank, iterations=tuple(logs), initial_shards=initial if keep else None,
                         shards=final if keep else None)

    def close(self) -> None:
        """Release what the strategy holds beyond memory (a pipeline strategy's process groups, whose gloo
        threads otherwise run until the process ends); collective like the constructor. For processes
        that build one trainer after another (benches, tests)."""
        close = getattr(self.strategy, "close", None)
        if close is not None:
            close()

    def evaluate(self, batch_fn: BatchFn, iteration: int) -> float:
        """Forward-only mean loss of one global batch from ``batch_fn`` (collective)."""
        return self.strategy.evaluate(batch_fn, iteration)

    def save_checkpoint(self, save: str, *, tokenizer_model: str | None = None) -> str:
        """Write model, optimizer, iteration and data position under ``save`` (collective); with the
        run's SentencePiece model when given, so the checkpoint converts with its tokenizer."""
        return self.strategy.save_checkpoint(save, self.iteration, tokenizer_model=tokenizer_model)

    def load_checkpoint(self, path: str, *, with_optimizer: bool = True) -> int:
        """Load a checkpoint written under any plan and continue from its iteration and its data position
        (its consumed samples: ``consumed_samples``) (collective)."""
        self.iteration = self.strategy.load_checkpoint(path, with_optimizer=with_optimizer)
        check_resumed_data(getattr(self.strategy, "batch_fn", None), getattr(self.strategy, "data_position", None),
                           train_iters=self.train.train_iters, global_batch_size=self.train.global_batch_size)
        return self.iteration

    def load_weights(self, path: str) -> int:
        """Megatron-LM's --finetune: the checkpoint's parameters only, trained from iteration 0 with a
        fresh optimizer and the data from its start; returns the checkpoint's iteration (collective)."""
        from megatron_het.train.data_position import DataPosition

        trained = self.strategy.load_checkpoint(path, with_optimizer=False)
        self.strategy.data_position = DataPosition()
        self.iteration = 0
        return trained

    @property
    def consumed_samples(self) -> int:
        """Training samples read so far (a resumed run: from the checkpoint's count on)."""
        return consumed_samples(self.strategy, self.iteration, self.train.global_batch_size)

    def shards(self) -> Mapping:
        """The strategy's current parameters as global-named shards (collective for some strategies)."""
        return self.strategy.shards()
