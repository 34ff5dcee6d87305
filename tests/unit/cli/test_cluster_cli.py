"""tools/cluster.py, run as a user would: a subprocess from the repository root, no installation."""

import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import REPO

ROOT = REPO
CLUSTERS = ROOT / "examples" / "clusters"


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "cluster.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def test_show_prints_islands_totals_links_and_emulation():
    result = run("show", "examples/clusters/cpu-demo.yaml")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "cluster: examples/clusters/cpu-demo.yaml" in out
    assert "fast  CPU     cpu/gloo     1 x 2" in out
    assert "CPU: 4" in out  # GPUs by device type
    assert "total: 4 GPUs, 4 TFLOP/s peak (dense bf16), 64 GiB device memory" in out
    assert "fast <-> slow: 10 Gbit/s per GPU, 50 us" in out
    assert "slow: slowdown 2" in out
    assert result.stderr == ""


def test_show_mixed_vendor_cluster():
    out = run("show", str(CLUSTERS / "a100-mi250x.yaml")).stdout
    assert "A100-80GB: 32" in out and "MI250X: 16" in out
    assert "amd/rccl" in out and "nvidia/nccl" in out
    assert "total: 48 GPUs, 13,048 TFLOP/s" in out  # 32 x 312 + 16 x 191.5


def test_bad_file_prints_error_on_stderr_exit_2_no_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("islands:\n  - {name: a, device: A100, nodes: 1, gpus_per_nod: 8}\n")
    result = run("show", str(bad))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(f"error: {bad}: islands[0].gpus_per_nod: unknown key")
    assert "did you mean 'gpus_per_node'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("content", "needle"), [(None, "file not found"), ("a: [1\n", "YAML syntax error"), ("", "file is empty")])
def test_unreadable_files_exit_2(tmp_path, content, needle):
    path = tmp_path / "c.yaml"
    if content is not None:
        path.write_text(content)
    result = run("show", str(path))
    assert result.returncode == 2 and needle in result.stderr and "Traceback" not in result.stderr


def test_catalog_lists_every_type_as_a_table_from_any_directory(tmp_path):
    result = run("catalog", cwd=tmp_path)  # the tool finds the package without installation
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["name", "vendor", "comm"]
    assert any(line.split()[:4] == ["MI300X", "amd", "rccl", "1,307.4"] for line in lines)
    assert "NVIDIA H100 Tensor Core GPU Datasheet (SXM5)" in result.stdout
    assert "sources:" not in run("catalog", "--no-sources").stdout


def test_model_subcommand():
    result = run("model", "examples/models/llama2-70b.yaml")
    assert result.returncode == 0
    assert "num_query_groups: 8" in result.stdout and "kv_channels: 128" in result.stdout


@pytest.mark.parametrize(("island", "needle"), [
    ("{name: a, device: A100-80GB, nodes: 1000000000, gpus_per_node: 8}", "islands[0].nodes: must be <= 65,536"),
    ("{name: a, device: A100-80GB, nodes: 60000, gpus_per_node: 200}", "islands: the islands hold 12,000,000 GPUs"),
    ('{name: "a\\n$(touch x),LD_PRELOAD=/tmp/x.so", device: A100-80GB, nodes: 1, gpus_per_node: 8}',
     "islands[0].name: must be 1-64 letters, digits"),
])
def test_show_refuses_absurd_counts_and_unsafe_names_in_one_line(tmp_path, island, needle):
    path = tmp_path / "c.yaml"
    path.write_text(f"islands:\n  - {island}\n")
    result = run("show", str(path), cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and needle in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "x").exists()


# A new-user review: swapped files were reported by their first unknown key ("islands: unknown key ... use
# one of ffn_hidden_size, ..."), which does not say what went wrong.
@pytest.mark.parametrize(("tool", "argv", "kind"), [
    ("plan", ["--cluster", "models/tiny-cpu.yaml", "--model", "clusters/cpu-demo.yaml", "--global-batch-size", "16",
              "--no-progress"], "cluster"),
    ("plan", ["--cluster", "models/tiny-cpu.yaml", "--model", "models/tiny-cpu.yaml", "--global-batch-size", "16",
              "--no-progress"], "model"),
    ("cluster", ["show", "models/tiny-cpu.yaml"], "model"),
    ("cluster", ["model", "clusters/cpu-demo.yaml"], "cluster"),
])
def test_swapped_cluster_and_model_files_are_named(capsys, monkeypatch, tool, argv, kind):
    from megatron_het.cli import cluster as cluster_cli
    from megatron_het.cli import plan as plan_cli

    monkeypatch.chdir(ROOT / "examples")
    main = plan_cli.main if tool == "plan" else cluster_cli.main
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"this looks like a {kind} file" in err and "did you swap --cluster and --model?" in err, err
    assert "unknown key" not in err
