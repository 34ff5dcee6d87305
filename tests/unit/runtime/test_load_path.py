"""--load naming a path that does not exist is a user error (exit 2, the path and the fix), not a
silent start from scratch; an existing directory without a checkpoint still starts from scratch."""

from __future__ import annotations

import os

import pytest

from megatron_het.runtime.arguments import parse_args

from support.paths import REPO

BASE = ["--hetero-cluster", os.path.join(REPO, "examples/clusters/cpu-demo.yaml"), "--hetero-plan", "auto",
        "--hetero-model", os.path.join(REPO, "examples/models/tiny-cpu.yaml"), "--micro-batch-size", "2",
        "--global-batch-size", "16", "--train-iters", "3", "--mock-data", "--lr", "1e-3"]


def test_missing_load_path_exits_2_naming_it_and_the_fix(tmp_path, capsys):
    missing = str(tmp_path / "chekpoints")
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + ["--load", missing])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--load {missing}: no such directory" in err
    assert "check the spelling, create the directory, or drop --load" in err


def test_load_path_that_is_a_file_exits_2(tmp_path, capsys):
    path = tmp_path / "iter_0000003.pt"
    path.write_text("")
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + ["--load", str(path)])
    assert exc.value.code == 2 and "is a file, not a checkpoint directory" in capsys.readouterr().err


def test_existing_empty_directory_and_restartable_save_load_are_accepted(tmp_path):
    assert parse_args(BASE + ["--load", str(tmp_path)]).loop.load == str(tmp_path)  # starts from scratch, as before
    ckpt = str(tmp_path / "ckpt")  # Megatron's --save DIR --load DIR: the first run creates DIR
    assert parse_args(BASE + ["--save", ckpt, "--load", ckpt]).loop.load == ckpt
