"""pretrain_gpt.py's sharded path end to end (issue 9): a ShardedPlan file, 4 gloo ranks, mock data.

Three iterations under shards 10/20/30/40% and batches 6/6/2/2 samples, saved with --save; resumed
with --load under shards 40/30/20/10% and batches 4/4/4/4 (micro-batch sizes 1/1/2/4, recompute on
rank 3) for iterations 4-5 with a validation pass. The five printed losses equal a single-process
megatron-core run (micro-batch 1 x 16) within 1e-5 relative (the log prints 7 significant digits).
The final checkpoint then loads under a pipeline Plan (2 replicas, TP=2) whose evaluation of the
same validation batch equals the sharded run's printed validation loss: one checkpoint format.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from megatron_het.model.groups import BlockShape
from megatron_het.platform.local_launch import run_local
from megatron_het.runtime.arguments import parse_args
from megatron_het.sharding import RankShare, ShardedPlan

from support.paths import REPO
from workers.megatron_workers import megatron_block_worker
from workers.sharding_workers import pretrain_sharded_worker

ROOT = str(REPO)
CLUSTER = os.path.join(ROOT, "examples/clusters/cpu-demo.yaml")
MODEL = os.path.join(ROOT, "examples/models/tiny-cpu.yaml")
PIPELINE_PLAN = os.path.join(ROOT, "examples/plans/cpu-demo-2replicas.json")  # 2 replicas, TP=2, mbs 2
ISLANDS = ("fast", "fast", "slow", "slow")


def argv(*extra: str) -> list[str]:
    return ["--hetero-cluster", CLUSTER, "--hetero-model", MODEL, "--hetero-plan", "unused",
            "--micro-batch-size", "2", "--global-batch-size", "16", "--mock-data", "--no-emulation",
            "--lr", "1e-3", "--lr-decay-style", "constant", "--log-interval", "1", "--eval-iters", "0", *extra]


def sharded(mbs, nmb, fractions, recompute=(False,) * 4) -> ShardedPlan:
    return ShardedPlan(ranks=tuple(RankShare(rank=i, island=ISLANDS[i], device_type="CPU", micro_batch_size=mbs[i],
                                             num_micro_batches=nmb[i], shard_fraction=fractions[i],
                                             recompute=recompute[i]) for i in range(4)), global_batch_size=16)


FIRST = sharded((2, 2, 2, 2), (3, 3, 1, 1), (0.1, 0.2, 0.3, 0.4))
SECOND = sharded((1, 1, 2, 4), (4, 4, 2, 1), (0.4, 0.3, 0.2, 0.1), (False, False, False, True))
LOSS = re.compile(r" iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) .*\| lm loss: ([0-9.E+-]+) \|")
VALID = re.compile(r" validation loss at iteration 5 \| lm loss value: ([0-9.E+-]+) \|")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pretrain_sharded")
    paths = []
    for name, plan in (("first", FIRST), ("second", SECOND)):
        paths.append(str(tmp / f"{name}.json"))
        plan.save(paths[-1])
    ckpt = str(tmp / "ckpt")
    steps = [(argv("--train-iters", "3", "--save", ckpt), paths[0]),
             (argv("--train-iters", "5", "--load", ckpt, "--save", ckpt, "--eval-interval", "5",
                   "--eval-iters", "1"), paths[1])]
    per_rank = run_local(4, pretrain_sharded_worker,
                         (steps, (argv("--train-iters", "5", "--eval-interval", "5", "--eval-iters", "1"), PIPELINE_PLAN,
                                  ckpt)), timeout_s=900)
    train = dataclasses.replace(parse_args(argv("--train-iters", "5")).train, micro_batch_size=1)
    model = parse_args(argv("--train-iters", "5")).model
    ref = run_local(1, megatron_block_worker, (model, train, BlockShape(tp=1, pp=1, dp=1), None, None,
                                               argv("--train-iters", "5")))[0]  # the batches pretrain reads
    return per_rank, ref, ckpt


@pytest.mark.slow
@pytest.mark.multiproc
def test_sharded_pretrain_matches_single_process_and_resumes_across_layouts(runs):
    per_rank, ref, ckpt = runs
    (res1, text1), (res2, text2) = per_rank[0]["steps"]
    assert [log.iteration for log in res1.logs + res2.logs] == [1, 2, 3, 4, 5]
    assert [it for it, _ in res2.validation] == [5] and res1.validation == ()
    assert per_rank[1]["steps"][0][1] == ""  # only rank 0 prints
    assert "rank 0: fast(CPU) micro-batch 2 x 3, state shard 10.00%" in text1
    assert "rank 3: slow(CPU) micro-batch 4 x 1, state shard 10.00%, recompute" in text2
    assert "loaded checkpoint" in text2 and "(iteration 3," in text2
    logged = [m.groups() for m in LOSS.finditer(text1 + text2)]
    assert [int(i) for i, _, _ in logged] == [1, 2, 3, 4, 5]
    assert [int(s) for _, s, _ in logged] == [16, 32, 48, 64, 80]
    ref_losses = [log.lm_loss for log in ref.iterations]
    for (i, _, loss), expected in zip(logged, ref_losses):
        assert abs(float(loss) - expected) <= 1e-5 * abs(expected), f"iteration {i}: {loss} vs {expected}"
    assert "per-rank time over the run" in text2 and text2.count("collectives") == 4
    assert sorted(os.listdir(ckpt)) == ["iter_0000003", "iter_0000005", "latest_checkpointed_iteration.txt"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_sharded_checkpoint_loads_under_a_pipeline_plan(runs):
    per_rank, _, _ = runs
    (_, text2) = per_rank[0]["steps"][1]
    valid = float(VALID.search(text2).group(1))
    assert per_rank[0]["steps"][1][0].validation[0][1] == pytest.approx(valid, rel=1e-6)
    loaded, pipeline_valid = per_rank[0]["pipeline"]
    assert loaded == 5
    assert pipeline_valid == pytest.approx(valid, rel=2e-6)  # printed with 7 significant digits
    assert pipeline_valid != pytest.approx(float(LOSS.findall(text2)[-1][2]), rel=1e-4)  # 6.2529 vs 6.2543
