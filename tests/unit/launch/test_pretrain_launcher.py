"""pretrain_gpt.py run without torchrun: one line saying how to launch (with the plan's rank count),
exit 2, instead of torch's env:// rendezvous traceback; argument and plan errors still come first."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch.distributed as dist

from megatron_het.launch.torchrun import RENDEZVOUS_VARIABLES, missing_rendezvous

from support.paths import REPO

ARGV = ["--hetero-cluster", os.path.join(REPO, "examples/clusters/cpu-demo.yaml"),
        "--hetero-plan", os.path.join(REPO, "examples/plans/cpu-demo-hetero.json"),
        "--hetero-model", os.path.join(REPO, "examples/models/tiny-cpu.yaml"),
        "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "3", "--mock-data",
        "--lr", "1e-3", "--log-interval", "1"]


@pytest.fixture
def entry(monkeypatch):
    for name in (*RENDEZVOUS_VARIABLES, "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    spec = importlib.util.spec_from_file_location("pretrain_gpt_entry", os.path.join(REPO, "pretrain_scripts/pretrain_gpt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_torchrun_one_line_with_the_plans_ranks(entry, capsys):
    assert not dist.is_initialized()
    assert entry.main(ARGV) == 2
    assert not dist.is_initialized()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("pretrain_gpt.py: error: not started by a launcher (RANK, WORLD_SIZE, MASTER_ADDR, "
                             "MASTER_PORT not set): launch with torchrun --nproc-per-node 4 ")
    assert "(the plan has 4 ranks;" in err[0]


def test_without_torchrun_a_bad_plan_is_reported_first(entry, tmp_path, capsys):
    bad = tmp_path / "plan.json"
    bad.write_text("{}")
    argv = [str(bad) if a.endswith("cpu-demo-hetero.json") else a for a in ARGV]
    assert entry.main(argv) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "launcher" not in err


def test_missing_rendezvous_names_what_torchrun_sets():
    assert missing_rendezvous({"RANK": "0", "WORLD_SIZE": "2"}) == ["MASTER_ADDR", "MASTER_PORT"]
    assert missing_rendezvous({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}) == []
