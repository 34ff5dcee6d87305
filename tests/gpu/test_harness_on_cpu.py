"""The GPU tier's harness, checked on every CPU run (no processes): not marked ``gpu``.

The GPU tests cannot run here, so what they feed pretrain_gpt.py could rot unnoticed until the day a
GPU is present. This builds every plan and cluster file they write (parity, bridge, mixed pair, memory)
and validates them through pretrain_gpt.py's own argument parser and the plan's validation, and checks
that the loss pattern the harness parses still matches the training loop's log line (~1 s).

The first-job recipe of docs/gpu.md (section 5), which test_gpu_first_job.py runs on 8 GPUs, is read
from the doc and run here as far as a CPU goes (~20 s): its data commands, its planner command (the
chosen plan must be the one the doc shows), and its training command through pretrain_gpt.py's parser,
the plan checks the trainer makes, its data at sequence length 4096, and pretrain_gpt.py's own main up
to the launcher check; its docker commands against the Dockerfile.
"""

from __future__ import annotations

import logging
import re

import pytest

from megatron_het.cli.pretrain import communication_line
from megatron_het.plan import Plan, ReplicaPlan
from megatron_het.runtime.arguments import parse_args
from megatron_het.train.loop import iteration_line

from support import first_job, gpu_run
from support.gpu_run import LOSS, MODEL_FILE, precision_flags, write_cluster
from support.paths import REPO


def _validate(tmp_path, plan: Plan, islands, *extra):
    plan.save(tmp_path / "plan.json")
    cluster = write_cluster(tmp_path / "cluster.json", islands)
    args = parse_args(["--hetero-cluster", str(cluster), "--hetero-model", str(MODEL_FILE), "--hetero-plan",
                       str(tmp_path / "plan.json"), "--micro-batch-size", str(plan.micro_batch_size),
                       "--global-batch-size", str(plan.global_batch_size), "--train-iters", "6", "--mock-data", "--lr", "1e-3",
                       "--no-emulation", *extra])
    plan.validate(args.model, args.cluster)
    return communication_line(plan, args.cluster)


@pytest.mark.parametrize("device", ["A100-80GB", "MI250X"])
def test_parity_and_bridge_plans_are_valid(tmp_path, monkeypatch, device):
    import test_gpu_bridge as bridge
    import test_gpu_parity as parity

    monkeypatch.setattr(gpu_run, "native_device", lambda: device)
    monkeypatch.setattr(parity, "native_device", lambda: device)
    monkeypatch.setattr(bridge, "native_device", lambda: device)
    for name, (gpus, replicas) in parity.PLANS.items():
        for precision in ("fp32", "bf16"):
            line = _validate(tmp_path, parity._plan(precision, *replicas), [("gpu", device, gpus)],
                             *precision_flags(precision))
            assert "one collective library" in line, (name, line)
    for gpus in (2, 4):
        (n_native, n_forced), replicas = bridge._case(gpus)
        plan = Plan(replicas=tuple(ReplicaPlan(stages=s, num_micro_batches=m) for s, m in replicas),
                    micro_batch_size=2, global_batch_size=8, precision="fp32")
        line = _validate(tmp_path, plan, [("native", device, n_native), ("forced", bridge._other_vendor(), n_forced)])
        assert "the plan spans collective libraries ['nccl', 'rccl']" in line, line
    for precision in ("fp32", "bf16"):  # the references' plan
        _validate(tmp_path, Plan.load(gpu_run.one_stage_plan(tmp_path / "one.json", precision, device)),
                  [("gpu", device, 1)], *precision_flags(precision))


@pytest.mark.parametrize("device", ["A100-80GB", "MI250X"])
def test_moe_plans_are_valid(tmp_path, device):
    """tests/gpu/test_gpu_moe.py's plans with its Megatron MoE flags, through the parser and Plan.validate."""
    import test_gpu_moe as moe

    for name, (gpus, replicas, fields) in moe.PLANS.items():
        line = _validate(tmp_path, moe.moe_plan(replicas, dev=device, **fields), [("gpu", device, gpus)],
                         *moe.MOE_FLAGS)
        assert "one collective library" in line, (name, line)


def test_mixed_vendor_plan_is_valid(tmp_path):
    import test_gpu_mixed_vendor as mixed

    line = _validate(tmp_path, mixed.mixed_plan(), mixed.ISLANDS)
    assert "the plan spans collective libraries ['nccl', 'rccl']" in line, line


def test_loss_pattern_matches_the_training_log():
    for scale in (None, 1024.0):
        line = iteration_line(iteration=3, train_iters=6, global_batch_size=8, elapsed_s=0.1, lr=1e-3, loss=6.245347,
                              grad_norm=1.0, tokens_per_s=100.0, loss_scale=scale, skipped=0 if scale else None)
        found = LOSS.search(line)
        assert found and int(found.group(1)) == 3 and float(found.group(2)) == pytest.approx(6.245347), line


# ---- the first-job recipe (docs/gpu.md section 5) ------------------------------------------------------

LIBRARY = {"nvidia": "nccl", "amd": "rccl"}


@pytest.fixture(scope="module")
def first_job_data(tmp_path_factory):
    """The recipe's data commands, run once in a work directory of their own: runs/first-job/data."""
    workdir = first_job.link_inputs(tmp_path_factory.mktemp("first-job-data"))
    cwd = pytest.MonkeyPatch()
    cwd.chdir(workdir)
    try:
        for argv in first_job.recipe("nvidia").data:
            assert first_job.run_in_process(argv) == 0, argv
    finally:
        cwd.undo()
    return workdir / "runs" / "first-job" / "data"


@pytest.mark.parametrize("vendor", first_job.VENDORS)
def test_first_job_docker_commands_match_the_dockerfile(vendor):
    recipe = first_job.recipe(vendor)
    build = next(a for a in recipe.docker if a[:2] == ["docker", "build"])
    run = next(a for a in recipe.docker if a[:2] == ["docker", "run"])
    dockerfile = (REPO / "Dockerfile").read_text()
    assert f"VENDOR={vendor}" in build and re.search(rf"^FROM \S+ AS base-{vendor}$", dockerfile, re.M), build
    assert run[-2] == build[build.index("-t") + 1] and run[-1] == "bash", run  # the image just built
    workdir = re.search(r"^WORKDIR (\S+)$", dockerfile, re.M).group(1)
    host, inside = run[run.index("-v") + 1].split(":")
    assert inside == f"{workdir}/runs" and any(a == ["mkdir", "-p", host] for a in recipe.docker), run
    needed = {"nvidia": ["--gpus", "--ipc=host", "--ulimit"],
              "amd": ["--device=/dev/kfd", "--device=/dev/dri", "--group-add", "--ipc=host"]}[vendor]
    assert set(needed) <= set(run), run


@pytest.mark.parametrize("vendor", first_job.VENDORS)
def test_first_job_recipe_on_cpu(vendor, first_job_data, tmp_path, monkeypatch, capsys):
    """The doc's plan and training commands as far as a CPU goes (pure: no process group)."""
    from megatron_het.cli.pretrain import batch_fns
    from megatron_het.cli.pretrain import main as pretrain_main
    from megatron_het.plan.validate import check_runtime_tp_grid, check_schedule, check_tp_comm_overlap
    from megatron_het.runtime.plan_record import reconcile_plan

    recipe = first_job.recipe(vendor)
    workdir = first_job.link_inputs(tmp_path)
    (workdir / "runs" / "first-job").mkdir(parents=True)
    (workdir / "runs" / "first-job" / "data").symlink_to(first_job_data, target_is_directory=True)
    monkeypatch.chdir(workdir)

    # the planner, exactly as the doc runs it, chooses the plan the doc shows
    capsys.readouterr()
    assert first_job.run_in_process(recipe.plan) == 0
    printed = capsys.readouterr().out
    chosen, shown = first_job.plan_summary(printed), first_job.plan_summary(recipe.plan_output)
    assert chosen == shown, (f"docs/gpu.md section 5 shows another plan for {vendor} than tools/plan.py now "
                             f"chooses: update the doc's planner output (and its prose).\n{printed}")
    plan = Plan.load(recipe.flag(recipe.plan, "--output"))

    # the training command: launcher, parser, and the checks pretrain_gpt.py and the trainer make
    assert recipe.train[:3] == first_job.LAUNCHER and "--standalone" in recipe.train, recipe.train
    args = parse_args(recipe.train_args)
    assert recipe.nproc_per_node == plan.world_size == args.cluster.num_gpus == 8
    assert recipe.flag(recipe.train_args, "--hetero-plan") == recipe.flag(recipe.plan, "--output")
    assert recipe.flag(recipe.train_args, "--hetero-cluster") == recipe.flag(recipe.plan, "--cluster")
    assert recipe.flag(recipe.train_args, "--hetero-model") == recipe.flag(recipe.plan, "--model")
    assert (args.train.micro_batch_size, args.train.global_batch_size) == (plan.micro_batch_size,
                                                                           plan.global_batch_size)
    assert args.train.train_iters == 20 and args.loop.save == "runs/first-job/checkpoints"
    plan.validate(args.model, args.cluster)
    plan, train = reconcile_plan(plan, args.train)
    assert train.precision == plan.precision == "bf16"
    check_schedule(plan, args.model)
    check_tp_comm_overlap(plan)
    check_runtime_tp_grid(plan)
    assert communication_line(plan, args.cluster) == (
        f"communication: one collective library ({LIBRARY[vendor]}): native groups only")
    assert {i.device.vendor for i in args.cluster.islands} == {vendor}

    # its data, at the model's 4096 tokens per sequence (no process group: built here alone)
    assert args.model.seq_length == 4096
    train_batches, valid_batches = batch_fns(args)
    assert tuple(train_batches(0, range(0, 2)).shape) == (2, 4097)
    assert valid_batches is not None and tuple(valid_batches(0, range(0, 1)).shape) == (1, 4097)

    # pretrain_gpt.py's own main goes as far as the launcher check (arguments and plan accepted)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    level = logging.getLogger("megatron_het").level
    try:
        code = pretrain_main(recipe.train_args)
    finally:
        logging.getLogger("megatron_het").setLevel(level)
    err = capsys.readouterr().err
    assert code == 2 and "not started by a launcher" in err and f"--nproc-per-node {plan.world_size}" in err, err
