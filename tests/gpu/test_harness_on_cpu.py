"""The GPU tier's harness, checked on every CPU run (no processes, ~1 s): not marked ``gpu``.

The GPU tests cannot run here, so what they feed pretrain_gpt.py could rot unnoticed until the day a
GPU is present. This builds every plan and cluster file they write (parity, bridge, mixed pair, memory)
and validates them through pretrain_gpt.py's own argument parser and the plan's validation, and checks
that the loss pattern the harness parses still matches the training loop's log line.
"""

from __future__ import annotations

import pytest

from megatron_het.cli.pretrain import communication_line
from megatron_het.plan import Plan, ReplicaPlan
from megatron_het.runtime.arguments import parse_args
from megatron_het.train.loop import iteration_line

from support import gpu_run
from support.gpu_run import LOSS, MODEL_FILE, precision_flags, write_cluster


def _validate(tmp_path, plan: Plan, islands, *extra):
    plan.save(tmp_path / "plan.json")
    cluster = write_cluster(tmp_path / "cluster.json", islands)
    args = parse_args(["--hetero-cluster", str(cluster), "--hetero-model", str(MODEL_FILE), "--hetero-plan",
                       str(tmp_path / "plan.json"), "--micro-batch-size", str(plan.micro_batch_size),
                       "--global-batch-size", str(plan.global_batch_size), "--train-iters", "6", "--mock-data",
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
