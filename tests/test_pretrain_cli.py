"""pretrain_gpt.py's argument boundary: bad input fails with the flag and the fix, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_het.runtime.arguments import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = os.path.join(ROOT, "examples/clusters/cpu-demo.yaml")
MODEL = os.path.join(ROOT, "examples/models/tiny-cpu.yaml")
BASE = ["--hetero-cluster", CLUSTER, "--hetero-plan", "auto", "--hetero-model", MODEL,
        "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "3"]


def test_model_file_and_flags_combine():
    args = parse_args(BASE + ["--mock-data", "--num-layers", "6", "--lr", "3e-4"])
    assert args.model.num_layers == 6 and args.model.hidden_size == 64
    assert args.train.lr == 3e-4 and args.train.global_batch_size == 16
    assert args.cluster.num_gpus == 4 and args.plan_source == "auto"


@pytest.mark.parametrize("extra,message", [
    ([], "give --data-path PREFIX"),
    (["--data-path", "x"], "--data-path needs --tokenizer-model"),
    (["--mock-data", "--global-batch-size", "15"], "global_batch_size 15 is not a multiple of micro_batch_size 2"),
    (["--mock-data", "--num-attention-heads", "5"], "num_attention_heads"),
])
def test_bad_arguments_name_the_problem(extra, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + extra)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cluster_typo_exits_cleanly(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("islands:\n  - name: a\n    device: A100-80G\n    nodes: 1\n    gpus_per_node: 2\n")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_scripts/pretrain_gpt.py"),
                           *BASE[:1], str(bad), *BASE[2:], "--mock-data"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "A100-80GB" in proc.stderr and "Traceback" not in proc.stderr
