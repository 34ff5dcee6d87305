"""Progress display: plain rate-limited lines off a TTY, one redrawn line on a TTY, silence when quiet."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest

from megatron_het.cluster import load_cluster, load_model
from megatron_het.planner import plan_cluster
from megatron_het.utils.progress import Progress, format_progress

from support.paths import REPO

ROOT = str(REPO)


class Clock:
    """A settable clock (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_format_has_count_percentage_rate_and_eta():
    assert format_progress("convert", 25, 100, 5.0, unit="tensors") == \
        "convert: 25/100 tensors ( 25.0%), 5 tensors/s, ETA 0:00:15"
    assert format_progress("convert", 100, 100, 20.0, unit="tensors", final=True) == \
        "convert: 100/100 tensors (100.0%), 5 tensors/s, done in 0:00:20"
    assert format_progress("read", 7, None, 2.0, unit="files") == "read: 7 files, 3.5 files/s"  # unknown total
    assert format_progress("x", 0, 10, 0.0, unit="items") == "x: 0/10 items (  0.0%), 0 items/s"  # no ETA yet


def test_plain_lines_are_rate_limited_when_not_a_tty():
    out, clock = io.StringIO(), Clock()
    with Progress("job", total=10, unit="docs", stream=out, interval_s=5.0, clock=clock) as bar:
        for i in range(1, 11):
            clock.now += 1.0  # one item per second: a line at most every 5 s
            bar.update(i)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines == ["job: 1/10 docs ( 10.0%), 1 docs/s, ETA 0:00:09",  # first update writes at once
                     "job: 6/10 docs ( 60.0%), 1 docs/s, ETA 0:00:04",
                     "job: 10/10 docs (100.0%), 1 docs/s, done in 0:00:10"]


def test_tty_redraws_one_line():
    out, clock = io.StringIO(), Clock()
    with Progress("job", total=3, unit="x", stream=out, tty=True, clock=clock) as bar:
        for i in (1, 2, 3):
            clock.now += 1.0
            bar.update(i)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("done in 0:00:03\n")
    assert text.count("\r") == 4  # three updates (>= 0.1 s apart) and the final line


def test_quiet_writes_nothing():
    out = io.StringIO()
    with Progress("job", total=3, stream=out, quiet=True) as bar:
        for _ in range(3):
            bar.advance()
    assert out.getvalue() == "" and bar.done == 3


def test_error_marks_the_last_line_interrupted():
    out, clock = io.StringIO(), Clock()
    with pytest.raises(KeyError):
        with Progress("job", total=4, unit="x", stream=out, clock=clock) as bar:
            clock.now += 1.0
            bar.update(2)
            raise KeyError("boom")
    assert out.getvalue().splitlines()[-1] == "job: 2/4 x ( 50.0%), 2 x/s, ETA 0:00:01 (interrupted)"


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match=r"interval_s: got 0, it must be > 0 seconds"):
        Progress("job", interval_s=0)


def test_plan_cluster_reports_monotone_progress_ending_at_the_total():
    calls: list[tuple[int, int]] = []
    result = plan_cluster(load_model(os.path.join(ROOT, "examples/models/tiny-cpu.yaml")),
                          load_cluster(os.path.join(ROOT, "examples/clusters/cpu-demo.yaml")),
                          global_batch_size=16, progress=lambda done, total: calls.append((done, total)))
    assert result.best is not None and len(calls) > 50
    dones = [d for d, _ in calls]
    assert dones == sorted(dones) and dones[0] == 1
    assert all(0 < d <= t for d, t in calls)
    assert calls[-1][0] == calls[-1][1]  # ends at the total
    # one step per structure priced (the explanation's count) plus one per plan predicted in full
    priced = int(re.search(r"(\d+) candidate plans priced", result.explanation).group(1))
    assert len(result.candidates) <= dones[-1] - priced <= 40


def test_plan_tool_progress_goes_to_stderr_and_is_silenced_by_no_progress():
    cmd = [sys.executable, os.path.join(ROOT, "tools/plan.py"), "--cluster", "examples/clusters/cpu-demo.yaml",
           "--model", "examples/models/tiny-cpu.yaml", "--global-batch-size", "16", "--top", "1"]
    shown = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    last = shown.stderr.strip().splitlines()[-1]
    assert last.startswith("plan: search: ") and "candidates (100.0%)" in last and "done in" in last
    assert "plan: search" not in shown.stdout
    quiet = subprocess.run(cmd + ["--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == shown.stdout
