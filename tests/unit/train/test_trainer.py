"""The one trainer with a scripted strategy (no processes): hooks, redo after a repaired failure,
learning rates, run targets, shards, and the emulation timer."""

from __future__ import annotations

import time

import pytest

from megatron_het.cluster import ModelSpec
from megatron_het.train.config import TrainConfig
from megatron_het.train.strategy import StepResult
from megatron_het.train.timer import EmulationTimer
from megatron_het.train.trainer import Trainer, TrainerHooks

MODEL = ModelSpec(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=16, vocab_size=32)
TRAIN = TrainConfig(micro_batch_size=1, global_batch_size=4, train_iters=5, lr=1.0, lr_decay_style="linear",
                    min_lr=0.0)


class Scripted:
    """A strategy that records its calls; raises once in the iterations listed in ``fail``."""

    model_spec, rank, reports_shards = MODEL, 0, True

    def __init__(self, fail=()):
        self.fail, self.steps, self.value = set(fail), [], 0.0

    def step(self, iteration, *, lr, timer, on_action):
        if on_action is not None:
            on_action(0, f"F{iteration}")
        if iteration in self.fail:
            self.fail.discard(iteration)
            raise RuntimeError(f"peer lost in {iteration}")
        timer.compute(lambda: None)
        self.steps.append((iteration, lr))
        self.value += 1
        return StepResult(lm_loss=10.0 - iteration, grad_norm=0.5, comm_s=0.25)

    def shards(self):
        return {"w": self.value}

    def load_checkpoint(self, path, *, with_optimizer=True):
        return int(path)


class Recorder(TrainerHooks):
    def __init__(self, repairs=True):
        self.events, self.repairs = [], repairs

    def on_step_start(self, trainer, iteration):
        self.events.append(("start", iteration))

    def on_action(self, trainer, iteration, index, action):
        self.events.append(("action", iteration, action))

    def on_step_end(self, trainer, log):
        self.events.append(("end", log.iteration))

    def on_failure(self, trainer, iteration, error):
        self.events.append(("failure", iteration, str(error)))
        return self.repairs


def test_a_repaired_failure_redoes_the_iteration_and_hooks_see_everything_in_order():
    strategy, hooks = Scripted(fail={1}), Recorder()
    result = Trainer(strategy=strategy, train=TRAIN, hooks=hooks).run(2, return_shards=True)
    assert hooks.events == [("start", 0), ("action", 0, "F0"), ("end", 1),
                            ("start", 1), ("action", 1, "F1"), ("failure", 1, "peer lost in 1"),
                            ("start", 1), ("action", 1, "F1"), ("end", 2)]
    assert [s[0] for s in strategy.steps] == [0, 1]
    assert [log.iteration for log in result.iterations] == [1, 2]
    assert [log.lm_loss for log in result.iterations] == [10.0, 9.0] and result.iterations[0].comm_s == 0.25
    assert result.initial_shards == {"w": 0.0} and result.shards == {"w": 2.0}


def test_an_unrepaired_failure_ends_the_run():
    with pytest.raises(RuntimeError, match="peer lost in 0"):
        Trainer(strategy=Scripted(fail={0}), train=TRAIN, hooks=Recorder(repairs=False)).run(1)
    with pytest.raises(RuntimeError, match="peer lost in 0"):
        Trainer(strategy=Scripted(fail={0}), train=TRAIN).run(1)


def test_learning_rate_follows_the_schedule_and_run_counts_from_the_loaded_iteration():
    strategy = Scripted()
    trainer = Trainer(strategy=strategy, train=TRAIN)
    assert trainer.load_checkpoint("2") == 2
    logs = trainer.run().iterations  # default: train_iters more steps
    assert [log.iteration for log in logs] == [3, 4, 5, 6, 7]
    assert [lr for _, lr in strategy.steps][:3] == pytest.approx([1 - 2 / 5, 1 - 3 / 5, 1 - 4 / 5])


def test_run_reaches_its_target_when_a_replan_rewinds():
    class Rewind(TrainerHooks):
        def on_step_end(self, trainer, log):
            if log.iteration == 3 and not getattr(self, "done", False):
                self.done = True
                trainer.use_strategy(Scripted(), iteration=1)  # continue from an older checkpoint

    trainer = Trainer(strategy=Scripted(), train=TRAIN, hooks=Rewind())
    logs = trainer.run(4).iterations
    assert [log.iteration for log in logs] == [1, 2, 3, 2, 3, 4] and trainer.iteration == 4


def test_timer_adds_the_emulated_wait_and_a_cpu_clock_ignores_sleeping():
    wall = EmulationTimer(slowdown=3.0)
    wall.compute(lambda: time.sleep(0.05))
    assert 0.14 <= wall.compute_s < 0.4 and 0.09 <= wall.emulated_s < 0.3  # 3 x 0.05 s, 2/3 of it waited
    wall.stretch(lambda: time.sleep(0.05))
    assert wall.compute_s < 0.4 and wall.emulated_s >= 0.19  # the optimizer's wait is not compute
    cpu = EmulationTimer(slowdown=3.0, clock=time.thread_time)
    cpu.compute(lambda: time.sleep(0.05))  # sleeping costs no CPU time: nothing to stretch
    assert cpu.emulated_s == 0.0 and 0.05 <= cpu.compute_s < 0.2
    same = EmulationTimer()
    same.compute(lambda: time.sleep(0.01))
    assert same.emulated_s == 0.0


def test_an_island_on_the_thread_clock_is_timed_in_cpu_time_and_repays_host_delays():
    from megatron_het.cluster import load_cluster
    from megatron_het.train.timer import emulation_timer

    paced = load_cluster("examples/clusters/cpu-demo-paced.yaml")  # the demo's cluster: clock thread
    timer = emulation_timer(paced, "slow")
    assert timer.slowdown == 8.0 and timer.clock is time.thread_time and timer.catch_up
    # a wait inside the compute (another process holding the core) is not stretched 8x: the rank is
    # 50 ms behind its emulated timeline, repaid from the next compute's wait
    timer.compute(lambda: time.sleep(0.05))
    assert timer.emulated_s == 0.0 and 0.05 <= timer.compute_s < 0.2 and timer.lag_s >= 0.04
    t0 = time.thread_time()
    timer.compute(lambda: sum(i * i for i in range(400_000)))
    spent = time.thread_time() - t0
    # both computes together last 8x their CPU time (the first's 50 ms absorbed), not 50 ms + 8x
    assert timer.compute_s == pytest.approx(8.0 * spent, rel=0.2) and timer.lag_s < 0.01
    wall = emulation_timer(load_cluster("examples/clusters/cpu-demo.yaml"), "slow")
    assert wall.clock is None and not wall.catch_up and wall.slowdown == 2.0
    assert emulation_timer(paced, "slow", clock=time.perf_counter).clock is time.perf_counter  # given wins


class OnDevice(Scripted):
    """Reports its loss and norm as tensors, as the real strategies do (values stay on the device)."""

    def step(self, iteration, *, lr, timer, on_action):
        import torch

        result = super().step(iteration, lr=lr, timer=timer, on_action=on_action)
        return StepResult(lm_loss=torch.tensor([result.lm_loss]), grad_norm=torch.tensor(0.5))


class PendingAtEnd(TrainerHooks):
    def __init__(self):
        self.pending = []

    def on_step_end(self, trainer, log):
        self.pending.append((log.iteration, log.readout.pending))


def test_device_values_are_read_once_per_log_interval_and_at_the_end():
    from workers.sync_workers import counting_host_reads

    hooks = PendingAtEnd()
    train = TrainConfig(micro_batch_size=1, global_batch_size=4, train_iters=7, lr=1.0, log_interval=3)
    with counting_host_reads({}) as reads:
        result = Trainer(strategy=OnDevice(), train=train, hooks=hooks).run()
    assert sum(reads.values()) == 3, reads  # one read at iterations 3, 6 and the end (7)
    # the hooks see a log-interval iteration already read (e.g. TensorBoard: no read of its own)
    assert [it for it, pending in hooks.pending if not pending] == [3, 6]
    assert [log.lm_loss for log in result.iterations] == [10.0 - i for i in range(7)]
    assert all(log.grad_norm == 0.5 for log in result.iterations)


def test_timer_catch_up_pays_back_host_delays_from_later_sleeps():
    """With ``catch_up`` a rank preempted mid-action (wall > clock x slowdown) sleeps that much less later:
    its compute adds up to the emulated durations plus only the lag still owed (the last sleep's late
    wake-up), where without it every overrun stays."""
    def run(catch_up: bool) -> EmulationTimer:
        fake = [0.0]  # the emulation clock, advanced by hand: "CPU time" of each action
        timer = EmulationTimer(slowdown=3.0, clock=lambda: fake[0])
        timer.catch_up = catch_up

        def action(cpu: float, host_delay: float) -> None:
            fake[0] += cpu
            time.sleep(host_delay)  # the host's delay: wall time the emulated device would not have spent

        timer.compute(lambda: action(0.01, 0.05))  # emulated 0.03 s, took >= 0.05 s: 0.02 s behind
        timer.compute(lambda: action(0.02, 0.0))  # emulated 0.06 s
        return timer

    caught, plain = run(True), run(False)
    assert plain.compute_s >= 0.11  # 0.05 + 0.06: the overrun stays
    assert caught.compute_s == pytest.approx(0.09 + caught.lag_s, abs=2e-3)  # 0.03 + 0.06, + the lag still owed


def test_timer_host_lock_is_held_around_the_timed_call_only():
    import contextlib

    held, seen = [False], []

    @contextlib.contextmanager
    def lock():
        held[0] = True
        try:
            yield
        finally:
            held[0] = False

    timer = EmulationTimer(slowdown=2.0, clock=time.thread_time)
    timer.host_lock = lock
    timer.compute(lambda: seen.append(held[0]))
    timer.stretch(lambda: seen.append(held[0]))
    assert seen == [True, True] and not held[0]  # released before the emulation's sleep
