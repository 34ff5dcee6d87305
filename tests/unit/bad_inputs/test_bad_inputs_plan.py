"""Bad inputs to tools/plan.py and tools/predict.py (#21): each is one line, exit 2, nothing written."""

from __future__ import annotations

import json

import pytest
from bad_input_harness import (
    CPU_4,
    CPU_DEMO,
    CPU_DEMO_TEXT,
    DEEP_JSON,
    DEEP_YAML,
    DEMO_PLAN_TEXT,
    GARBAGE,
    NON_UTF8,
    PYTHON_TAG_YAML,
    TINY,
    TINY_TEXT,
    Row,
    check_row,
)

from megatron_het.cli import plan as plan_cli
from megatron_het.cli import predict as predict_cli

BASE = ("--cluster", CPU_DEMO, "--model", TINY)
PLAN = (*BASE, "--global-batch-size", "16")


def _plan_json(**changes) -> str:
    data = json.loads(DEMO_PLAN_TEXT)
    for key, value in changes.items():
        if key.startswith("replica_"):
            data["replicas"][0][key.removeprefix("replica_")] = value
        else:
            data[key] = value
    return json.dumps(data)


def _gap_plan() -> str:
    data = json.loads(DEMO_PLAN_TEXT)
    data["replicas"][0]["stages"][1]["layers"] = [3, 3]  # layer 3 held by no stage
    data["replicas"][0]["stages"][0]["layers"] = [0, 2]
    return json.dumps(data)


PLAN_ROWS = [
    Row(id="gbs-not-int", argv=(*BASE, "--global-batch-size", "many"), names=("--global-batch-size",)),
    Row(id="flag-typo", argv=(*BASE, "--globl-batch-size", "16"), names=("--globl-batch-size", "--global-batch-size")),
    Row(id="missing-required", argv=BASE, names=("--global-batch-size",)),
    Row(id="mode-typo", argv=(*PLAN, "--mode", "pipelined"), names=("--mode",)),
    Row(id="cluster-missing", argv=("--cluster", "nope.yaml", "--model", TINY, "--global-batch-size", "16"),
        names=("nope.yaml",)),
    Row(id="cluster-directory", argv=("--cluster", "adir", "--model", TINY, "--global-batch-size", "16"),
        dirs=("adir",), names=("adir",)),
    Row(id="cluster-garbage", argv=("--cluster", "c.yaml", "--model", TINY, "--global-batch-size", "16"),
        files={"c.yaml": GARBAGE}, names=("c.yaml",)),
    Row(id="cluster-non-utf8", argv=("--cluster", "c.yaml", "--model", TINY, "--global-batch-size", "16"),
        files={"c.yaml": NON_UTF8}, names=("c.yaml",)),
    Row(id="cluster-deep-yaml", argv=("--cluster", "c.yaml", "--model", TINY, "--global-batch-size", "16"),
        files={"c.yaml": DEEP_YAML}, names=("c.yaml",)),
    Row(id="cluster-python-tag", argv=("--cluster", "c.yaml", "--model", TINY, "--global-batch-size", "16"),
        files={"c.yaml": PYTHON_TAG_YAML}, names=("c.yaml",)),
    Row(id="cluster-billion-nodes", argv=("--cluster", "c.yaml", "--model", TINY, "--global-batch-size", "16"),
        files={"c.yaml": CPU_DEMO_TEXT.replace("nodes: 1\n    gpus_per_node: 2          # 2",
                                               "nodes: 1000000000\n    gpus_per_node: 2          # 2")},
        names=("c.yaml",)),
    Row(id="model-empty", argv=("--cluster", CPU_DEMO, "--model", "m.yaml", "--global-batch-size", "16"),
        files={"m.yaml": ""}, names=("m.yaml",)),
    Row(id="model-wrong-type", argv=("--cluster", CPU_DEMO, "--model", "m.yaml", "--global-batch-size", "16"),
        files={"m.yaml": TINY_TEXT.replace("num_layers: 4", "num_layers: four")}, names=("m.yaml",)),
    Row(id="gbs-zero", argv=(*BASE, "--global-batch-size", "0"), names=("--global-batch-size", "global_batch_size")),
    Row(id="gbs-10e12", argv=(*BASE, "--global-batch-size", str(10**12)),
        names=("--global-batch-size", "global_batch_size")),
    Row(id="seq-length-huge", argv=(*PLAN, "--seq-length", str(10**12)), names=("--seq-length", "seq_length")),
    Row(id="top-zero", argv=(*PLAN, "--top", "0"), names=("--top",)),
    Row(id="top-negative", argv=(*PLAN, "--top", "-3"), names=("--top",)),
    Row(id="output-directory", argv=(*PLAN, "--output", "out"), dirs=("out",), names=("out",)),
    Row(id="output-missing-parent", argv=(*PLAN, "--output", "no/such/plan.json"), names=("no/such/plan.json",)),
    Row(id="output-parent-is-file", argv=(*PLAN, "--output", "f.txt/plan.json"), files={"f.txt": "x"},
        names=("f.txt/plan.json",)),
    Row(id="profile-missing", argv=(*PLAN, "--profile", "p.json"), names=("p.json",)),
    Row(id="profile-directory", argv=(*PLAN, "--profile", "pdir"), dirs=("pdir",), names=("pdir",)),
    Row(id="profile-garbage", argv=(*PLAN, "--profile", "p.json"), files={"p.json": GARBAGE}, names=("p.json",)),
    Row(id="profile-deep-json", argv=(*PLAN, "--profile", "p.json"), files={"p.json": DEEP_JSON},
        names=("p.json",)),
    Row(id="profile-non-utf8", argv=(*PLAN, "--profile", "p.json"), files={"p.json": b'{"x": "\xff\xfe"}'},
        names=("p.json",)),
    Row(id="profile-wrong-shape", argv=(*PLAN, "--profile", "p.json"), files={"p.json": "[1, 2, 3]"},
        names=("p.json",)),
]

PREDICT_ROWS = [
    Row(id="plan-and-tp", argv=(*BASE, "--plan", "p.json", "--tp", "2"), files={"p.json": DEMO_PLAN_TEXT},
        names=("--tp",)),
    Row(id="plan-and-gbs", argv=(*BASE, "--plan", "p.json", "--global-batch-size", "8"),
        files={"p.json": DEMO_PLAN_TEXT}, names=("--global-batch-size",)),
    Row(id="neither-form", argv=BASE, names=("--plan",)),
    Row(id="tp-not-int", argv=(*BASE, "--tp", "two"), names=("--tp",)),
    Row(id="plan-missing", argv=(*BASE, "--plan", "p.json"), names=("p.json",)),
    Row(id="plan-directory", argv=(*BASE, "--plan", "pdir"), dirs=("pdir",), names=("pdir",)),
    Row(id="plan-garbage", argv=(*BASE, "--plan", "p.json"), files={"p.json": GARBAGE}, names=("p.json",)),
    Row(id="plan-truncated", argv=(*BASE, "--plan", "p.json"), files={"p.json": DEMO_PLAN_TEXT[:300]},
        names=("p.json",)),
    Row(id="plan-deep-json", argv=(*BASE, "--plan", "p.json"), files={"p.json": DEEP_JSON}, names=("p.json",)),
    Row(id="plan-non-utf8", argv=(*BASE, "--plan", "p.json"), files={"p.json": DEMO_PLAN_TEXT.encode()[:40]
                                                                      + b"\xff\xfe" + DEMO_PLAN_TEXT.encode()[40:]},
        names=("p.json",)),
    Row(id="plan-missing-layer", argv=(*BASE, "--plan", "p.json"), files={"p.json": _gap_plan()},
        names=("p.json",)),
    Row(id="plan-huge-micro-batches", argv=(*BASE, "--plan", "p.json"),
        files={"p.json": _plan_json(global_batch_size=2 * 10**12, replica_num_micro_batches=10**12)},
        names=("p.json",)),
    Row(id="plan-bool-as-int", argv=(*BASE, "--plan", "p.json"), files={"p.json": _plan_json(micro_batch_size=True)},
        names=("p.json",)),
    Row(id="homogeneous-gbs-10e12", argv=("--cluster", CPU_4, "--model", TINY, "--tp", "1", "--pp", "1", "--dp", "4",
                                          "--micro-batch-size", "1", "--global-batch-size", str(10**12)),
        names=("--global-batch-size", "global_batch_size")),
    Row(id="homogeneous-tp-zero", argv=("--cluster", CPU_4, "--model", TINY, "--tp", "0", "--pp", "1", "--dp", "4",
                                        "--micro-batch-size", "1", "--global-batch-size", "8"), names=("--tp", "tp")),
    Row(id="homogeneous-on-two-islands", argv=(*BASE, "--tp", "1", "--pp", "1", "--dp", "4", "--micro-batch-size",
                                               "1", "--global-batch-size", "8"), names=("--cluster",)),
]


@pytest.mark.parametrize("row", PLAN_ROWS, ids=lambda r: r.id)
def test_plan_refuses(row, tmp_path, capsys, monkeypatch):
    check_row(plan_cli.main, row, tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize("row", PREDICT_ROWS, ids=lambda r: r.id)
def test_predict_refuses(row, tmp_path, capsys, monkeypatch):
    check_row(predict_cli.main, row, tmp_path, capsys, monkeypatch)
