"""TensorBoard logging of pretrain_gpt: event files read back against the run's own logs."""

from __future__ import annotations

import glob
import os
import sys

import pytest

from megatron_het.runtime.arguments import parse_args
from megatron_het.runtime.tensorboard_log import (
    StageTime,
    TensorBoardConfig,
    iteration_scalars,
    stage_scalars,
    stage_times,
)

from support.paths import REPO

ROOT = str(REPO)
CLUSTER = os.path.join(ROOT, "examples/clusters/cpu-pair.yaml")
MODEL = os.path.join(ROOT, "examples/models/tiny-cpu.yaml")
GBS, SEQ, ITERS = 8, 64, 3
PLAN = """{"format": "megatron-het-plan", "version": 1, "micro_batch_size": 2, "global_batch_size": 8,
 "schedule": "1f1b", "replicas": [{"num_micro_batches": 4, "stages": [
   {"island": "fast", "device_type": "CPU", "ranks": [0], "layers": [0, 3]},
   {"island": "slow", "device_type": "CPU", "ranks": [1], "layers": [3, 4]}]}]}"""


def _argv(plan: str, tb_dir: str, iters: int = ITERS) -> list[str]:
    return ["--hetero-cluster", CLUSTER, "--hetero-plan", plan, "--hetero-model", MODEL, "--no-emulation",
            "--micro-batch-size", "2", "--global-batch-size", str(GBS), "--train-iters", str(iters), "--mock-data", "--lr", "1e-3",
            "--lr-decay-style", "constant",
            "--log-interval", "1",
            "--eval-interval", "2", "--eval-iters", "1", "--tensorboard-dir", tb_dir,
            "--log-timers-to-tensorboard", "--log-memory-to-tensorboard", "--log-throughput"]


def pretrain_worker(rank: int, world: int, argv: list[str], failing_argv: list[str]):
    """A full run, then a run whose second iteration raises on every rank (the event file must survive)."""
    from megatron_het.cli.pretrain import run
    from megatron_het.platform import detect_accelerator
    from megatron_het.train.trainer import Trainer

    result = run(parse_args(argv), detect_accelerator())
    step = Trainer._step

    def failing(self, it):
        if it == 1:
            raise RuntimeError("injected failure at iteration 2")
        return step(self, it)

    Trainer._step = failing
    try:
        run(parse_args(failing_argv), detect_accelerator())
        failed = None
    except RuntimeError as e:
        failed = str(e)
    return result, failed


def _scalars(tb_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))
    assert len(files) == 1, files  # one writer: rank 0
    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow  # ~60 s: two spawned ranks import megatron-core and build the model twice
@pytest.mark.multiproc
def test_event_files_match_the_run(tmp_path):
    from megatron_het.platform.local_launch import run_local

    plan = tmp_path / "plan.json"
    plan.write_text(PLAN)
    tb, tb_fail = str(tmp_path / "tb"), str(tmp_path / "tb-fail")
    per_rank = run_local(2, pretrain_worker, (_argv(str(plan), tb), _argv(str(plan), tb_fail)), timeout_s=300)
    (r0, failed), (r1, _) = per_rank
    got = _scalars(tb)
    rel = 1e-6  # event files store float32

    steps = list(range(1, ITERS + 1))
    assert [s for s, _ in got["lm loss"]] == steps
    for (_, value), log in zip(got["lm loss"], r0.logs):
        assert value == pytest.approx(log.lm_loss, rel=rel)
    for (_, value), log in zip(got["grad-norm"], r0.logs):
        assert value == pytest.approx(log.grad_norm, rel=rel)
    assert [v for _, v in got["learning-rate"]] == pytest.approx([1e-3] * ITERS, rel=rel)
    assert [v for _, v in got["batch-size"]] == [GBS] * ITERS

    # Throughput is the global batch over the writer's iteration time.
    for (_, time_s), (_, tokens), (_, samples), log in zip(got["iteration-time"], got["throughput/tokens-per-s"],
                                                           got["throughput/samples-per-s"], r0.logs):
        assert time_s == pytest.approx(log.elapsed_s, rel=rel)
        assert tokens == pytest.approx(GBS * SEQ / time_s, rel=rel)
        assert samples == pytest.approx(GBS / time_s, rel=rel)

    # One compute and one idle series per stage of the plan, each stage from its own rank.
    stage_tags = sorted(t for t in got if t.startswith("stage-time/"))
    assert stage_tags == ["stage-time/0.0/compute", "stage-time/0.0/idle", "stage-time/0.1/compute",
                          "stage-time/0.1/idle"]
    for tag, logs, field in (("stage-time/0.0/compute", r0.logs, "compute_s"), ("stage-time/0.0/idle", r0.logs, "idle_s"),
                             ("stage-time/0.1/compute", r1.logs, "compute_s"), ("stage-time/0.1/idle", r1.logs, "idle_s")):
        assert [s for s, _ in got[tag]] == steps
        assert [v for _, v in got[tag]] == pytest.approx([getattr(l, field) for l in logs], rel=rel)

    # Memory: the run-wide peak is the largest stage peak; a torch process is > 100 MB.
    for i in range(ITERS):
        stage_peaks = [got[f"mem-max-allocated-bytes/0.{s}"][i][1] for s in (0, 1)]
        assert got["mem-max-allocated-bytes"][i][1] == max(stage_peaks) > 100e6
        assert 0 < got["mem-allocated-bytes"][i][1] <= got["mem-max-allocated-bytes"][i][1]

    assert [(s, pytest.approx(v, rel=rel)) for s, v in got["lm loss validation"]] == list(r0.validation)
    assert [it for it, _ in r0.validation] == [2, ITERS]  # every --eval-interval, and at the end as Megatron

    # The failed run's event file was flushed and closed: iteration 1 is there.
    assert failed == "injected failure at iteration 2"
    assert [s for s, _ in _scalars(tb_fail)["lm loss"]] == [1]


def test_stage_times_average_each_stage_over_its_ranks():
    samples = [(0, 1, "slow", 3.0, 1.0, 2, 500, 400), (0, 0, "fast", 2.0, 4.0, 2, 300, 300),
               (0, 1, "slow", 5.0, 3.0, 2, 700, 100)]
    assert stage_times(samples) == [
        StageTime(replica=0, stage=0, island="fast", compute_s=2.0, idle_s=4.0, iterations=2,
                  peak_memory_bytes=300, memory_bytes=300),
        StageTime(replica=0, stage=1, island="slow", compute_s=4.0, idle_s=2.0, iterations=2,
                  peak_memory_bytes=700, memory_bytes=400)]
    config = TensorBoardConfig(log_dir="x", log_timers=True, log_memory=True)
    assert stage_scalars(stage_times(samples), config=config) == {
        "stage-time/0.0/compute": 1.0, "stage-time/0.0/idle": 2.0, "mem-max-allocated-bytes/0.0": 300.0,
        "stage-time/0.1/compute": 2.0, "stage-time/0.1/idle": 1.0, "mem-max-allocated-bytes/0.1": 700.0,
        "mem-max-allocated-bytes": 700.0, "mem-allocated-bytes": 400.0}
    assert stage_scalars(stage_times(samples), config=TensorBoardConfig(log_dir="x")) == {}


def test_iteration_scalars_follow_the_flags():
    from megatron_het.train.readout import Readout
    from megatron_het.train.strategy import IterationLog

    log = IterationLog(iteration=4, readout=Readout(lm_loss=6.5, grad_norm=0.25), elapsed_s=0.5)
    base = iteration_scalars(log, lr=2e-4, global_batch_size=8, seq_length=64, config=TensorBoardConfig(log_dir="x"))
    assert base == {"lm loss": 6.5, "learning-rate": 2e-4, "grad-norm": 0.25, "batch-size": 8.0}
    full = iteration_scalars(log, lr=2e-4, global_batch_size=8, seq_length=64,
                             config=TensorBoardConfig(log_dir="x", log_timers=True, log_throughput=True))
    assert full["iteration-time"] == 0.5
    assert full["throughput/tokens-per-s"] == 1024.0 and full["throughput/samples-per-s"] == 16.0
    norms = IterationLog(iteration=4, readout=Readout(lm_loss=6.5, grad_norm=0.25, params_norm=30.5, num_zeros=640),
                         elapsed_s=0.5)  # --log-params-norm, --log-num-zeros-in-grad: Megatron's tags
    scalars = iteration_scalars(norms, lr=2e-4, global_batch_size=8, seq_length=64, config=TensorBoardConfig(log_dir="x"))
    assert scalars["params-norm"] == 30.5 and scalars["num-zeros"] == 640
    from megatron_het.train.strategy import MOE_KEY

    moe = IterationLog(iteration=4, readout=Readout(lm_loss=6.5, grad_norm=0.25, **{
        f"{MOE_KEY}load_balancing_loss": 1.02, f"{MOE_KEY}z_loss": 0.5}), elapsed_s=0.5)
    scalars = iteration_scalars(moe, lr=2e-4, global_batch_size=8, seq_length=64, config=TensorBoardConfig(log_dir="x"))
    assert (scalars["load_balancing_loss"], scalars["z_loss"]) == (1.02, 0.5)  # megatron-core's tags


BASE = ["--hetero-cluster", CLUSTER, "--hetero-plan", "auto", "--hetero-model", MODEL, "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "3", "--mock-data", "--lr", "1e-3"]


def test_flags_become_a_config(tmp_path):
    args = parse_args(BASE + ["--tensorboard-dir", str(tmp_path), "--tensorboard-log-interval", "5",
                              "--tensorboard-queue-size", "10", "--log-throughput"])
    assert args.tensorboard == TensorBoardConfig(log_dir=str(tmp_path), log_interval=5, queue_size=10,
                                                 log_throughput=True)
    assert parse_args(BASE + ["--log-throughput"]).tensorboard is None


@pytest.mark.parametrize("flag,value", [("--tensorboard-log-interval", "0"), ("--tensorboard-queue-size", "-3")])
def test_bad_interval_names_flag_value_and_limit(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + ["--tensorboard-dir", str(tmp_path), flag, value])
    assert exc.value.code == 2
    assert f"{flag}: got {value}, the minimum is 1" in capsys.readouterr().err


def test_missing_tensorboard_package_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + ["--tensorboard-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "the `tensorboard` package is not importable" in err and "pip install tensorboard" in err
