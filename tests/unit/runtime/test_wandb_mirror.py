"""--wandb-*: Weights & Biases mirrors the TensorBoard writer's scalars, as Megatron-LM's wandb writer
does; a missing wandb, project name or directory is refused by name before any rendezvous."""

from __future__ import annotations

import os
import sys
import types

import pytest

from megatron_het.checkpoint.convert.io import single_process_group
from megatron_het.runtime.arguments import parse_args
from megatron_het.runtime.tensorboard_log import TensorBoardHooks
from megatron_het.train.config import TensorBoardConfig

from support.paths import REPO

BASE = ["--hetero-cluster", os.path.join(REPO, "examples/clusters/cpu-demo.yaml"), "--hetero-plan",
        os.path.join(REPO, "examples/plans/cpu-demo-hetero.json"), "--hetero-model",
        os.path.join(REPO, "examples/models/tiny-cpu.yaml"), "--train-iters", "3", "--lr", "1e-3", "--mock-data"]


def _fake_wandb(calls: list):
    class Run:
        def log(self, data, step):
            calls.append((data, step))

        def finish(self):
            calls.append("finish")

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    return types.SimpleNamespace(init=init)


def test_the_writing_rank_mirrors_every_scalar_to_wandb(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    config = TensorBoardConfig(log_dir=str(tmp_path / "tb"), wandb_project="het", wandb_exp_name="run-1",
                               wandb_save_dir=str(tmp_path / "wandb"), wandb_entity="team")
    with single_process_group():
        hooks = TensorBoardHooks(config, group=None, global_batch_size=8, seq_length=16, run_config={"lr": 1e-3})
        hooks.log_validation(3, 2.5)
        hooks.close()
    assert calls[0] == ("init", {"dir": str(tmp_path / "wandb"), "name": "run-1", "project": "het",
                                 "config": {"lr": 1e-3}, "entity": "team"})
    assert calls[1:] == [({"lm loss validation": 2.5}, 3), "finish"]
    assert (tmp_path / "wandb").is_dir() and any((tmp_path / "tb").iterdir())  # the event file too


@pytest.mark.parametrize("extra,message", [
    (["--wandb-project", "het", "--wandb-exp-name", "r"], "--wandb-project het: W&B mirrors the TensorBoard"),
    (["--wandb-project", "het", "--tensorboard-dir", "TB"], "--wandb-project het: the run needs a name"),
    (["--wandb-project", "het", "--wandb-exp-name", "r", "--tensorboard-dir", "TB"], "under --wandb-save-dir"),
    (["--wandb-project", "het", "--wandb-exp-name", "r", "--tensorboard-dir", "TB", "--save", "S"],
     "wandb is not installed in this environment. Fix: pip install wandb"),
])
def test_wandb_flags_are_refused_by_name_before_rendezvous(extra, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed (an import raises ImportError)
    extra = [str(tmp_path / e) if e in ("TB", "S") else e for e in extra]
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + extra)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
