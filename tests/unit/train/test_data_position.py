"""A resumed run's data position is the checkpoint's consumed-samples count (Megatron-LM), not
``iteration * global_batch_size``: a changed global batch size continues where the data stopped, and
every offset and logged count derives from the one value (train/data_position.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_het.data.gpt_data import GptDataConfig, GptSplit, gpt_batch_fn
from megatron_het.errors import UserError
from megatron_het.train.config import TrainConfig
from megatron_het.train.data_position import DataPosition, position_from_checkpoint, positioned_batches
from megatron_het.train.loop import iteration_line
from megatron_het.train.strategy import StepResult
from megatron_het.train.timer import EmulationTimer
from megatron_het.train.trainer import Trainer


def test_resumed_position_continues_from_the_checkpoints_count():
    # 20 iterations of 16 = 320 samples, resumed at global batch 4: iteration 20 reads 320..323
    pos = position_from_checkpoint({"iteration": 20, "consumed_samples": 320}, global_batch_size=4)
    assert pos == DataPosition(20, 320)
    assert pos.consumed_at(20, 4) == 320  # the first sample of the first resumed batch
    assert pos.consumed_at(22, 4) == 328  # consumed after iteration 22 (not 22 * 4 = 88)
    assert DataPosition().consumed_at(5, 16) == 80  # a fresh run: iteration * global batch


def test_checkpoint_without_the_count_resumes_as_before():
    assert position_from_checkpoint({"iteration": 20}, global_batch_size=4) == DataPosition(20, 80)


class FakeSplit:
    """A dataset whose sample k has every token equal to k."""

    def __init__(self, n: int, seq_length: int = 3) -> None:
        self.n, self.seq_length = n, seq_length

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int) -> dict:
        return {"tokens": torch.full((self.seq_length,), k), "labels": torch.full((self.seq_length,), k)}


def split(n: int, gbs: int) -> GptSplit:
    return GptSplit(name="train", dataset=FakeSplit(n), global_batch_size=gbs, seq_length=3)


def first_column(batch: torch.Tensor) -> list[int]:
    return batch[:, 0].tolist()


def test_gpt_batches_follow_the_position():
    batches = gpt_batch_fn(split(400, 4))
    assert first_column(batches(2, range(4))) == [8, 9, 10, 11]  # fresh: iteration * gbs + i
    resumed = positioned_batches(batches, DataPosition(20, 320), 4)
    assert first_column(resumed(20, range(1, 3))) == [321, 322]
    assert first_column(resumed(21, range(4))) == [324, 325, 326, 327]
    with pytest.raises(ValueError, match="iteration: 21 needs train sample 400, but the split has 400"):
        positioned_batches(batches, DataPosition(20, 396), 4)(21, range(4))


def test_iteration_keyed_batches_are_left_as_given():
    def fn(iteration, indices):
        return iteration

    assert positioned_batches(fn, DataPosition(20, 320), 4) is fn


def test_resumed_data_config_covers_the_consumed_samples():
    base = dict(data_path=("x",), seq_length=8, global_batch_size=4, train_iters=22)
    assert GptDataConfig(**base).num_samples()[0] == 88
    assert GptDataConfig(**base, resume_iteration=20, resume_consumed_samples=320).num_samples()[0] == 328


def test_log_line_prints_the_given_count():
    kw = dict(iteration=21, train_iters=22, global_batch_size=4, elapsed_s=0.1, lr=1e-3, loss=6.0, grad_norm=1.0,
              tokens_per_s=1.0)
    assert "consumed samples:        324 |" in iteration_line(**kw, consumed_samples=324)
    assert "consumed samples:         84 |" in iteration_line(**kw)  # no position: a fresh run's count


class RecordingStrategy:
    """The strategy protocol's parts the trainer uses; records the first sample of each batch."""

    model_spec = type("M", (), {"seq_length": 3})()
    rank, reports_shards = 0, False

    def __init__(self, batch_fn, gbs: int) -> None:
        self.batch_fn, self.gbs, self.data_position, self.firsts = batch_fn, gbs, DataPosition(), []

    def step(self, iteration, *, lr, timer, on_action):
        batch = positioned_batches(self.batch_fn, self.data_position, self.gbs)(iteration, range(self.gbs))
        self.firsts.append(int(batch[0, 0]))
        return StepResult(lm_loss=torch.tensor(1.0), grad_norm=torch.tensor(0.0))

    def load_checkpoint(self, path, *, with_optimizer=True):  # as the strategies: position from the common state
        self.data_position = position_from_checkpoint({"iteration": 20, "consumed_samples": 320}, self.gbs)
        return 20


def test_trainer_resumes_data_and_logs_from_the_checkpoints_count():
    train = TrainConfig(micro_batch_size=2, global_batch_size=4, train_iters=22, lr=1e-3)
    strategy = RecordingStrategy(gpt_batch_fn(split(400, 4)), 4)
    trainer = Trainer(strategy=strategy, train=train, timer=EmulationTimer())
    trainer.load_checkpoint("ckpt/iter_0000020")
    assert trainer.consumed_samples == 320
    logs = trainer.run(2).iterations
    assert strategy.firsts == [320, 324]
    assert [log.consumed_samples for log in logs] == [324, 328]
    assert trainer.consumed_samples == 328
    # a re-plan's new strategy keeps the position
    other = RecordingStrategy(strategy.batch_fn, 4)
    trainer.use_strategy(other, iteration=trainer.iteration)
    assert other.data_position == DataPosition(20, 320) and trainer.consumed_samples == 328



def test_resume_beyond_the_split_is_refused_at_load_naming_the_fix():
    train = TrainConfig(micro_batch_size=2, global_batch_size=4, train_iters=22, lr=1e-3)
    strategy = RecordingStrategy(gpt_batch_fn(split(88, 4)), 4)  # sized for 22 x 4 from sample 0
    with pytest.raises(UserError, match=r"--load: the checkpoint's run consumed 320 training samples in 20 "
                                        r"iterations; iterations 21-22 at global batch size 4 read samples up to "
                                        r"327, but the train split has 88 .*global batch size \(its global batch "
                                        r"size: 16\)"):
        Trainer(strategy=strategy, train=train, timer=EmulationTimer()).load_checkpoint("ckpt/iter_0000020")
    mock = RecordingStrategy(lambda iteration, indices: torch.zeros((len(indices), 4), dtype=torch.long), 4)
    Trainer(strategy=mock, train=train, timer=EmulationTimer()).load_checkpoint("ckpt/iter_0000020")  # no end
