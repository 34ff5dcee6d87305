"""tools/plan.py and tools/predict.py: exit codes, JSON keys, files written.

The first test runs both tools through subprocess (the shims, as a user does); the others call the same
``main(argv)`` in this process (``call``), which is all the shims run, without paying a fresh Python +
torch start-up (~3 s of CPU) for each of their fifteen runs.
"""

import json
import subprocess
import sys

import pytest

from megatron_het.cli.plan import main as plan_main
from megatron_het.cli.predict import main as predict_main

from support.paths import REPO

ROOT = REPO
CPU_DEMO = ["--cluster", "examples/clusters/cpu-demo.yaml", "--model", "examples/models/tiny-cpu.yaml"]


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"tools/{tool}", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def call(capsys, monkeypatch):
    """``call("plan.py", *args)``: the tool's ``main(args)`` here, from the repository root like ``_run``, with the
    exit code, stdout and stderr as ``_run`` returns them (argparse errors exit 2 there and here alike)."""
    monkeypatch.chdir(ROOT)

    def run(tool: str, *args: str) -> subprocess.CompletedProcess:
        main = {"plan.py": plan_main, "predict.py": predict_main}[tool]
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess([tool, *args], code, out, err)

    return run


def test_plan_writes_best_and_predict_reads_it(tmp_path):
    out = tmp_path / "plan.json"
    res = _run("plan.py", *CPU_DEMO, "--global-batch-size", "16", "--top", "3", "--output", str(out))
    assert res.returncode == 0, res.stderr
    assert "TFLOP/s/GPU" in res.stdout and "wrote" in res.stdout
    plan = json.loads(out.read_text())
    assert plan["format"] == "megatron-het-plan" and plan["predicted"]["fits"] is True
    res = _run("predict.py", *CPU_DEMO, "--plan", str(out), "--json")
    assert res.returncode == 0, res.stderr
    pred = json.loads(res.stdout)
    for key in ("iteration_time_s", "tokens_per_s", "tflops_per_gpu", "memory_gib_per_rank_max", "fits"):
        assert key in pred
    assert abs(pred["iteration_time_s"] - plan["predicted"]["iteration_time_s"]) < 1e-12


def test_plan_json_lists_top_plans(call):
    res = call("plan.py", *CPU_DEMO, "--global-batch-size", "8", "--top", "2", "--json")
    assert res.returncode == 0, res.stderr
    plans = json.loads(res.stdout)
    assert len(plans) == 2 and all("predicted" in p for p in plans)
    assert plans[0]["predicted"]["iteration_time_s"] <= plans[1]["predicted"]["iteration_time_s"]


def test_plan_infeasible_exits_2_without_traceback(call):
    res = call("plan.py", "--cluster", "examples/clusters/cpu-demo.yaml", "--model", "examples/models/llama2-70b.yaml",
               "--global-batch-size", "16")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and "no plan fits llama2-70b" in res.stderr


def test_bad_file_exits_2(call):
    res = call("plan.py", "--cluster", "nope.yaml", "--model", "examples/models/tiny-cpu.yaml",
               "--global-batch-size", "16")
    assert res.returncode == 2 and "Traceback" not in res.stderr and "error:" in res.stderr


def test_predict_homogeneous_form(call):
    res = call("predict.py", "--cluster", "examples/clusters/cpu-4.yaml", "--model", "examples/models/tiny-cpu.yaml",
               "--tp", "2", "--pp", "2", "--dp", "1", "--micro-batch-size", "2", "--global-batch-size", "16",
               "--virtual-pipeline-size", "2", "--recompute-activations", "--json")
    assert res.returncode == 0, res.stderr
    pred = json.loads(res.stdout)
    assert pred["num_gpus"] == 4 and pred["fits"] is True and pred["tokens_per_s"] > 0
    res = call("predict.py", "--cluster", "examples/clusters/cpu-demo.yaml", "--model", "examples/models/tiny-cpu.yaml",
               "--tp", "1", "--pp", "1", "--dp", "1", "--micro-batch-size", "1", "--global-batch-size", "4")
    assert res.returncode == 2 and "one-island cluster" in res.stderr and "Traceback" not in res.stderr


def test_predict_reads_a_sharded_plan_written_by_plan(tmp_path, call):
    out = tmp_path / "sharded.json"
    res = call("plan.py", *CPU_DEMO, "--global-batch-size", "16", "--mode", "sharded", "--no-progress",
               "--output", str(out))
    assert res.returncode == 0, res.stderr
    res = call("predict.py", *CPU_DEMO, "--plan", str(out), "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["mode"] == "sharded" and got["iteration_time_s"] > 0 and len(got["ranks"]) == 4
    text = call("predict.py", *CPU_DEMO, "--plan", str(out))
    assert text.returncode == 0 and "all-gather" in text.stdout and text.stdout.count("rank ") == 4


def test_plan_output_for_1024_ranks_fits_a_screen_and_verbose_lists_everything(call):
    args = ("--cluster", "examples/clusters/tangram-1024.yaml", "--model", "examples/models/llama2-7b.yaml",
            "--global-batch-size", "2048", "--no-progress")
    res = call("plan.py", *args)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) <= 40, res.stdout
    assert any(line.startswith("ranks: ") and "-" in line for line in lines)  # ranks as ranges
    assert "pipeline best" in res.stdout and "sharded" in res.stdout  # both predictions stated
    verbose = call("plan.py", *args, "--verbose")
    assert verbose.returncode == 0, verbose.stderr
    assert len(verbose.stdout.splitlines()) > 200 and "replica 0:" in verbose.stdout


def test_plan_tp_3d_writes_grids_where_the_4d_model_wins_and_only_then(tmp_path, call):
    """--tp-3d plugs AxoNN's parallelizer in: one node of 8 A100s and a 13B GPT get 3D grids (the 4D model's
    case in tests/unit/planner/test_planner_tp3d.py), written without the distributed optimizer (3D stages
    do not run it); without the flag the same plan has none."""
    (tmp_path / "n8.yaml").write_text("islands:\n  - {name: a100, device: A100-80GB, nodes: 1, gpus_per_node: 8}\n")
    (tmp_path / "gpt13b.yaml").write_text("num_layers: 40\nhidden_size: 5120\nnum_attention_heads: 40\n"
                                          "seq_length: 2048\nvocab_size: 50304\nname: gpt-13b\n")
    args = ["--cluster", str(tmp_path / "n8.yaml"), "--model", str(tmp_path / "gpt13b.yaml"),
            "--global-batch-size", "32", "--mode", "pipeline", "--no-progress"]
    grids = {}
    for flag in ("--tp-3d", None):
        out = tmp_path / f"plan{flag or ''}.json"
        res = call("plan.py", *args, *([flag] if flag else []), "--output", str(out))
        assert res.returncode == 0, res.stderr
        plan = json.loads(out.read_text())
        grids[flag] = [s.get("tp_grid") for r in plan["replicas"] for s in r["stages"]]
        if flag:
            assert "3D grid [2, 1, 1] (AxoNN)" in res.stdout and plan["use_distributed_optimizer"] is False
    assert grids["--tp-3d"] and all(g == [2, 1, 1] for g in grids["--tp-3d"])
    assert all(g is None for g in grids[None])


def test_plan_precision_is_priced_and_recorded(tmp_path, call):
    """--precision: the plan records it and is priced at it (fp32 holds 4-byte weights: more memory than bf16)."""
    memory = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / f"{precision}.json"
        res = call("plan.py", *CPU_DEMO, "--global-batch-size", "16", "--mode", "pipeline", "--precision", precision,
                   "--output", str(out), "--no-progress")
        assert res.returncode == 0, res.stderr
        plan = json.loads(out.read_text())
        assert plan["precision"] == precision
        memory[precision] = plan["predicted"]["memory_gib_per_rank_max"]
    assert memory["fp32"] > memory["bf16"]
    res = call("plan.py", *CPU_DEMO, "--global-batch-size", "16", "--precision", "fp64")
    assert res.returncode == 2 and "invalid choice: 'fp64'" in res.stderr
