"""A closed trainer leaves no process group or gloo thread behind (#16: bench/schedules.py built three
trainers per process and every earlier one's 10 groups and ~30 gloo threads per rank stayed alive)."""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch  # noqa: F401  (before the C extension, as everywhere)
import torch.distributed as dist

from megatron_het.cluster import ModelSpec
from megatron_het.plan import homogeneous_plan
from megatron_het.runtime.group_ledger import GroupLedger, live_groups

from support.one_rank import one_rank_world

MODEL = ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64)


@pytest.fixture
def world():
    with one_rank_world():
        yield


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled_threads(target: int, timeout_s: float = 5.0) -> int:
    """The thread count once it reaches ``target`` (a destroyed group's threads exit asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while (n := _threads()) != target and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def test_ledger_destroys_only_its_owners_groups(world):
    earlier = dist.new_group([0])
    ledger = GroupLedger()
    mine = [dist.new_group([0]) for _ in range(3)]
    ledger.seal()
    later = dist.new_group([0])  # after the seal: not the owner's
    assert ledger.groups == mine
    ledger.destroy()
    live = live_groups()
    assert all(g not in live for g in mine)
    assert earlier in live and later in live and dist.group.WORLD in live
    ledger.destroy()  # idempotent


def _pipeline_trainer(train, batch_fn):
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    plan = homogeneous_plan(tp=1, pp=1, dp=1, num_layers=MODEL.num_layers, micro_batch_size=1, global_batch_size=2,
                            island="a", device_type="CPU")
    return HeteroTrainer(model=MODEL, plan=plan, train=train, batch_fn=batch_fn)


def _sharded_trainer(train, batch_fn):
    from megatron_het.plan import RankShare, ShardedPlan
    from megatron_het.sharding.trainer import ShardedTrainer

    plan = ShardedPlan(ranks=(RankShare(rank=0, island="a", device_type="CPU", micro_batch_size=1,
                                        num_micro_batches=2, shard_fraction=1.0),), global_batch_size=2)
    return ShardedTrainer(model=MODEL, plan=plan, train=train, batch_fn=batch_fn)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
@pytest.mark.parametrize("build", [_pipeline_trainer, _sharded_trainer], ids=["pipeline", "sharded"])
def test_closed_trainer_leaves_no_group_or_thread(world, build):
    from megatron_het.data.synthetic import synthetic_batch
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.train.config import TrainConfig

    enable_cpu_backend()
    train = TrainConfig(micro_batch_size=1, global_batch_size=2, train_iters=1, lr=1e-4, log_interval=1)

    def batch_fn(iteration, indices):
        return synthetic_batch(seed=1, iteration=iteration, indices=indices, seq_length=MODEL.seq_length,
                               vocab_size=MODEL.vocab_size)

    def build_run_close() -> tuple[int, int]:
        trainer = build(train, batch_fn)
        trainer.run(1)
        built = len(live_groups()), _threads()
        trainer.close()
        del trainer
        gc.collect()
        return built

    gc.collect()
    groups = len(live_groups())
    build_run_close()  # the first run also starts torch's own threads, once per process
    threads = _threads()
    built_groups, built_threads = build_run_close()
    assert built_groups > groups and built_threads > threads  # the checks below can fail
    assert len(live_groups()) == groups
    assert _settled_threads(threads) == threads, (threads, built_threads)
