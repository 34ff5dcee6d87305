"""tools/calibrate.py and the precision flags / breakdown of tools/predict.py (#17)."""

import json
import subprocess
import sys

from megatron_het.cli.calibrate import main as calibrate_main
from megatron_het.cli.predict import main as predict_main

from support.paths import REPO

ONE_A100 = "islands:\n  - {name: pod, device: A100-80GB, nodes: 1, gpus_per_node: 8}\n"
LLAMA = str(REPO / "examples/models/llama2-7b.yaml")


def test_calibrate_writes_profiles_that_predict_reads(tmp_path, capsys):
    out = tmp_path / "fit"
    assert calibrate_main(["--sources", "torchtitan", "--output", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fit"]["sources"] == ["torchtitan"] and report["fit"]["rows"] == 5
    assert {p.rsplit("/", 1)[1] for p in report["written"]} >= {"A100-80GB.json", "H100-SXM.json"}
    cluster = tmp_path / "c.yaml"
    cluster.write_text(ONE_A100)
    args = ["--cluster", str(cluster), "--model", LLAMA, "--tp", "1", "--pp", "1", "--dp", "8",
            "--micro-batch-size", "1", "--global-batch-size", "64", "--json"]
    assert predict_main(args) == 0
    default = json.loads(capsys.readouterr().out)
    assert predict_main(args + ["--profile", str(out / "A100-80GB.json")]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert fitted["iteration_time_s"] != default["iteration_time_s"]
    assert sum(fitted["breakdown_s"].values()) == fitted["iteration_time_s"] or \
        abs(sum(fitted["breakdown_s"].values()) / fitted["iteration_time_s"] - 1) < 1e-9


def test_calibrate_errors_are_one_line(tmp_path, capsys):
    assert calibrate_main(["--sources", "nosuchsource"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nosuchsource" in err and err.count("\n") == 1
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert calibrate_main(["--sources", "torchtitan", "--output", str(blocker)]) == 2
    assert "--output" in capsys.readouterr().err


def test_predict_precision_flags_and_breakdown(tmp_path, capsys):
    cluster = tmp_path / "c.yaml"
    cluster.write_text(ONE_A100)
    base = ["--cluster", str(cluster), "--model", LLAMA, "--tp", "2", "--pp", "2", "--dp", "2",
            "--micro-batch-size", "1", "--global-batch-size", "16"]
    times = {}
    for flag in ("--bf16", "--fp32", "--tf32", "--fp16"):
        assert predict_main(base + [flag, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["precision"] == flag[2:]
        times[flag] = out["iteration_time_s"]
    assert times["--bf16"] < times["--tf32"] < times["--fp32"]
    assert predict_main(base) == 0
    text = capsys.readouterr().out
    assert "where the iteration goes (bf16" in text and "GEMM MLP fc1" in text and "per-kernel fixed costs" in text


def test_predict_refuses_a_precision_flag_beside_a_plan(tmp_path):
    res = subprocess.run([sys.executable, "tools/predict.py", "--cluster", "examples/clusters/cpu-demo.yaml",
                          "--model", "examples/models/tiny-cpu.yaml", "--plan", "examples/plans/cpu-demo-hetero.json",
                          "--fp32"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--fp32 cannot be combined with --plan" in res.stderr
