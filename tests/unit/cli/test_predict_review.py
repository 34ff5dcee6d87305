"""predict.py / plan.py / cluster.py findings of a new-user review: ``| head`` tracebacks, a virtual
pipeline size of 0 read as 1, half-open layer ranges."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_het.cli import cluster as cluster_cli
from megatron_het.cli import plan as plan_cli
from megatron_het.cli import predict

from support.paths import EXAMPLES, REPO

CPU_DEMO = str(EXAMPLES / "clusters" / "cpu-demo.yaml")
CPU_2 = str(EXAMPLES / "clusters" / "cpu-2.yaml")
TINY = str(EXAMPLES / "models" / "tiny-cpu.yaml")
DEMO_PLAN = str(EXAMPLES / "plans" / "cpu-demo-hetero.json")


class _ClosedPipe:
    """A stdout whose reader went away after ``lines`` writes."""

    def __init__(self, lines: int) -> None:
        self.left = lines

    def write(self, text: str) -> int:
        if self.left <= 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.left -= 1
        return len(text)

    def flush(self) -> None:
        if self.left <= 0:
            raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize(("tool", "argv"), [
    (predict.main, ["--cluster", CPU_DEMO, "--model", TINY, "--plan", DEMO_PLAN]),
    (plan_cli.main, ["--cluster", CPU_DEMO, "--model", TINY, "--global-batch-size", "16", "--no-progress"]),
    (cluster_cli.main, ["show", CPU_DEMO]),
])
def test_closed_pipe_ends_quietly(monkeypatch, capsys, tool, argv):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe(2))
    assert tool(argv) == 1  # no BrokenPipeError escapes
    assert capsys.readouterr().err == ""


def test_shim_piped_into_head_prints_no_traceback():
    proc = subprocess.Popen([sys.executable, str(REPO / "tools" / "predict.py"), "--cluster", CPU_DEMO, "--model",
                             TINY, "--plan", DEMO_PLAN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    proc.stdout.close()  # the reader is gone before the tool writes anything
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    proc.stderr.close()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert err == ""


@pytest.mark.parametrize("v", ["0", "-3"])
def test_virtual_pipeline_size_below_1_is_refused(capsys, v):
    with pytest.raises(SystemExit) as exc:
        predict.main(["--cluster", CPU_2, "--model", TINY, "--tp", "1", "--pp", "2", "--dp", "1",
                      "--micro-batch-size", "1", "--global-batch-size", "4", "--virtual-pipeline-size", v])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--virtual-pipeline-size must be >= 1" in err and f"got {v}" in err and "1f1b" not in err


def test_layer_ranges_are_inclusive_like_plan_py(capsys):
    assert predict.main(["--cluster", CPU_DEMO, "--model", TINY, "--plan", DEMO_PLAN]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("0 ")]
    assert [row[5] for row in rows] == ["L0-2", "L3-3"]  # the plan's layers [0, 3) and [3, 4)


def test_plan_output_is_written_even_when_the_pipe_closes(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe(1))
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--cluster", CPU_DEMO, "--model", TINY, "--global-batch-size", "16", "--no-progress",
                          "--output", str(out)]) == 1
    assert out.exists()
