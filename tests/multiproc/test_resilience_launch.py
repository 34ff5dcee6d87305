"""run_resilient_local: a SIGKILLed rank is an outcome, and its orphaned helpers do not outlive the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_het.resilience.launch import run_resilient_local


def helper_then_die(rank, world_size, address, pid_file):
    """Start a long-lived helper (like megatron's checkpoint-writer manager), then SIGKILL itself."""
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(pid_file, "w") as f:
        f.write(str(helper.pid))
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead, merely not reaped yet
    except FileNotFoundError:
        return False


@pytest.mark.multiproc
def test_killed_rank_is_an_outcome_and_its_helper_is_killed(tmp_path):
    pid_file = str(tmp_path / "helper.pid")
    outcomes = run_resilient_local(1, helper_then_die, (pid_file,), timeout_s=120)
    assert [(o.status, o.exitcode) for o in outcomes] == [("died", -9)]
    helper = int(open(pid_file).read())
    deadline = time.monotonic() + 10.0  # SIGKILL is sent at the end of the run; let the kernel act on it
    while _alive(helper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(helper), f"helper {helper} of the killed rank outlived the run"
