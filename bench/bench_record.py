"""What every benchmark writes beside its figures: the machine, its load, the code it ran.

Imported by the scripts in this folder as ``bench_record`` (Python puts a script's own folder first
on its path, so no set-up is needed). Results files are written through the project's one atomic
writer.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

from megatron_het.utils.atomic import write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def machine() -> dict:
    """This host as a results file records it (the machines are shared: the load matters)."""
    import torch

    return {"cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "load_average": list(os.getloadavg())}


def perf_commit() -> str:
    """Which commit of megatron_het/perf this run imported: the most recent of the last ten perf
    commits whose files match the imported package, else the last one + "uncommitted changes"
    (predictions depend on the performance model, which changes between commits)."""
    import megatron_het.perf as perf_pkg

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout

    here = Path(perf_pkg.__file__).parent
    mine = {f.name: f.read_text() for f in here.glob("*.py")}
    commits = git("log", "-10", "--format=%h", "--", "megatron_het/perf").split()
    for commit in commits:
        files = git("ls-tree", "--name-only", commit, "megatron_het/perf/").split()
        theirs = {Path(p).name: git("show", f"{commit}:{p}") for p in files if p.endswith(".py")}
        if theirs == mine:
            return f"{commit} (as committed)"
    return f"{commits[0] if commits else '?'} + uncommitted changes"


def write_result(name: str, payload: dict) -> Path:
    """``bench/results/NAME`` (atomic), indented JSON with a trailing newline; returns the path."""
    path = RESULTS / name
    write_text_atomic(path, json.dumps(payload, indent=2, default=str) + "\n")
    return path
