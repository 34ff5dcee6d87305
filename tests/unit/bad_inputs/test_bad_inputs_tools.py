"""Bad inputs to profile_host.py, cluster.py, slurm.py and pretrain_gpt.py's argument parsing (#21).

cluster.py and slurm.py rows are written to the contract; their fixes (island names, plan checks,
exit code 2) belong to megatron_het/cluster/, launch/ and cli/{cluster,slurm}.py.
"""

from __future__ import annotations

import json

import pytest
from bad_input_harness import (
    CPU_DEMO,
    CPU_DEMO_TEXT,
    DEEP_YAML,
    DEMO_PLAN,
    DEMO_PLAN_TEXT,
    GARBAGE,
    NON_UTF8,
    PYTHON_TAG_YAML,
    TINY,
    TINY_TEXT,
    Row,
    check_row,
)

from megatron_het.cli import cluster as cluster_cli
from megatron_het.cli import profile_host
from megatron_het.cli import slurm as slurm_cli

SHAPE = ("--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16")

PROFILE_ROWS = [
    Row(id="hidden-not-int", argv=("--hidden-size", "wide", "--num-attention-heads", "4", "--seq-length", "16",
                                   "--output", "p.json"), names=("--hidden-size",)),
    Row(id="mbs-garbage", argv=(*SHAPE, "--micro-batch-sizes", "1,x", "--output", "p.json"),
        names=("--micro-batch-sizes",)),
    Row(id="mbs-zero", argv=(*SHAPE, "--micro-batch-sizes", "0", "--output", "p.json"),
        names=("--micro-batch-sizes",)),
    Row(id="output-directory", argv=(*SHAPE, "--output", "out"), dirs=("out",), names=("out",)),
    Row(id="output-missing-parent", argv=(*SHAPE, "--output", "no/such/p.json"), names=("no/such/p.json",)),
    Row(id="threads-zero", argv=(*SHAPE, "--threads", "0", "--output", "p.json"), names=("--threads",)),
    Row(id="heads-not-dividing", argv=("--hidden-size", "64", "--num-attention-heads", "5", "--seq-length", "16",
                                       "--output", "p.json"), names=("num_attention_heads", "--num-attention-heads")),
    Row(id="hidden-huge", argv=("--hidden-size", str(10**12), "--num-attention-heads", "4", "--seq-length", "16",
                                "--output", "p.json"), names=("hidden_size", "--hidden-size")),
    Row(id="seq-length-zero", argv=("--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "0",
                                    "--output", "p.json"), names=("seq_length", "--seq-length")),
    Row(id="mbs-huge", argv=(*SHAPE, "--micro-batch-sizes", str(10**9), "--output", "p.json"),
        names=("--micro-batch-sizes",)),
    Row(id="comm-ranks-one", argv=(*SHAPE, "--comm-ranks", "1", "--output", "p.json"), names=("--comm-ranks",)),
    Row(id="dtype-typo", argv=(*SHAPE, "--dtype", "float16", "--output", "p.json"), names=("--dtype",)),
    Row(id="warmup-negative", argv=(*SHAPE, "--warmup", "-1", "--output", "p.json"), names=("--warmup",)),
    Row(id="repeats-zero", argv=(*SHAPE, "--repeats", "0", "--output", "p.json"), names=("--repeats",)),
]

CLUSTER_ROWS = [
    Row(id="show-missing", argv=("show", "c.yaml"), names=("c.yaml",)),
    Row(id="show-directory", argv=("show", "cdir"), dirs=("cdir",), names=("cdir",)),
    Row(id="show-garbage", argv=("show", "c.yaml"), files={"c.yaml": GARBAGE}, names=("c.yaml",)),
    Row(id="show-non-utf8", argv=("show", "c.yaml"), files={"c.yaml": NON_UTF8}, names=("c.yaml",)),
    Row(id="show-deep-yaml", argv=("show", "c.yaml"), files={"c.yaml": DEEP_YAML}, names=("c.yaml",)),
    Row(id="show-python-tag", argv=("show", "c.yaml"), files={"c.yaml": PYTHON_TAG_YAML}, names=("c.yaml",)),
    Row(id="show-8e9-gpus", argv=("show", "c.yaml"),
        files={"c.yaml": "islands:\n  - {name: big, device: A100-80GB, nodes: 1000000000, gpus_per_node: 8}\n"},
        names=("c.yaml",)),
    Row(id="show-device-typo", argv=("show", "c.yaml"), files={"c.yaml": CPU_DEMO_TEXT.replace("device: CPU",
                                                                                               "device: CPUU", 1)},
        names=("c.yaml",)),
    Row(id="model-negative", argv=("model", "m.yaml"), files={"m.yaml": TINY_TEXT.replace("hidden_size: 64",
                                                                                          "hidden_size: -64")},
        names=("m.yaml",)),
    Row(id="subcommand-typo", argv=("shwo", CPU_DEMO), names=("shwo",)),
]


def _cluster_named(name: str) -> str:
    return CPU_DEMO_TEXT.replace("name: slow", f"name: {json.dumps(name)}").replace(
        "between: [fast, slow]", f"between: [fast, {json.dumps(name)}]").replace(
        "slow: {slowdown: 2.0}", f"{json.dumps(name)}: {{slowdown: 2.0}}")


def _gap_plan() -> str:
    data = json.loads(DEMO_PLAN_TEXT)
    data["replicas"][0]["stages"][0]["layers"] = [0, 2]  # layer 2 held by no stage
    return json.dumps(data)


SLURM = ("--cluster", CPU_DEMO, "--plan", DEMO_PLAN, "--model", TINY)
SLURM_ROWS = [
    Row(id="island-newline", argv=("--cluster", "c.yaml", "--plan", DEMO_PLAN, "--model", TINY),
        files={"c.yaml": _cluster_named("slow\nrm -rf ~")}, names=("c.yaml",)),
    Row(id="island-command-substitution", argv=("--cluster", "c.yaml", "--plan", DEMO_PLAN, "--model", TINY),
        files={"c.yaml": _cluster_named("$(touch pwned)")}, names=("c.yaml",)),
    Row(id="island-comma", argv=("--cluster", "c.yaml", "--plan", DEMO_PLAN, "--model", TINY),
        files={"c.yaml": _cluster_named("slow,LD_PRELOAD=/tmp/x.so")}, names=("c.yaml",)),
    Row(id="plan-missing-layer", argv=("--cluster", CPU_DEMO, "--plan", "p.json", "--model", TINY), files={"p.json": _gap_plan()},
        names=("p.json",)),
    Row(id="plan-missing", argv=("--cluster", CPU_DEMO, "--plan", "p.json", "--model", TINY), names=("p.json",)),
    Row(id="output-directory", argv=(*SLURM, "--output", "out"), dirs=("out",), names=("out",)),
    Row(id="output-missing-parent", argv=(*SLURM, "--output", "no/such/job.sbatch"), names=("no/such/job.sbatch",)),
    Row(id="partition-no-equals", argv=(*SLURM, "--partition", "fast"), names=("--partition",)),
    Row(id="partition-unknown-island", argv=(*SLURM, "--partition", "fsat=p0"), names=("--partition", "fsat")),
    Row(id="master-port-not-int", argv=(*SLURM, "--master-port", "http"), names=("--master-port",)),
    Row(id="no-model", argv=("--cluster", CPU_DEMO, "--plan", DEMO_PLAN), names=("--model",)),
]


@pytest.mark.parametrize("row", PROFILE_ROWS, ids=lambda r: r.id)
def test_profile_host_refuses(row, tmp_path, capsys, monkeypatch):
    check_row(profile_host.main, row, tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize("row", CLUSTER_ROWS, ids=lambda r: r.id)
def test_cluster_refuses(row, tmp_path, capsys, monkeypatch):
    check_row(cluster_cli.main, row, tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize("row", SLURM_ROWS, ids=lambda r: r.id)
def test_slurm_refuses(row, tmp_path, capsys, monkeypatch):
    check_row(slurm_cli.main, row, tmp_path, capsys, monkeypatch)


