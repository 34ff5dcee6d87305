"""Files and directories the tools write get the permissions open()/mkdir would give (0666/0777 less
the umask), not mkstemp's 0600 / mkdtemp's 0700 (a new-user review: plans and HF exports unreadable to
the group even with umask 0022)."""

from __future__ import annotations

import os
import stat

import pytest

from megatron_het.checkpoint.convert.io import atomic_output_dir
from megatron_het.utils.atomic import current_umask, write_text_atomic


@pytest.fixture(params=[0o022, 0o027, 0o002])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_current_umask_reads_without_changing_it(umask):
    assert current_umask() == umask
    assert current_umask() == umask


def test_atomic_file_gets_open_default_mode(tmp_path, umask):
    target = tmp_path / "plan.json"
    write_text_atomic(target, "{}")
    reference = tmp_path / "reference"
    reference.write_text("{}")  # what open() gives under this umask
    assert _mode(target) == 0o666 & ~umask == _mode(reference)
    write_text_atomic(target, "{}")  # replacing keeps the default too
    assert _mode(target) == 0o666 & ~umask


def test_explicit_mode_still_wins(tmp_path, umask):
    target = tmp_path / "job.sbatch"
    write_text_atomic(target, "#!/bin/bash\n", mode=0o755)
    assert _mode(target) == 0o755


def test_atomic_output_dir_gets_mkdir_default_mode(tmp_path, umask):
    out = tmp_path / "hf"
    with atomic_output_dir(str(out)) as tmp:
        (open(os.path.join(tmp, "config.json"), "w")).close()
    reference = tmp_path / "reference"
    reference.mkdir()
    assert _mode(out) == 0o777 & ~umask == _mode(reference)
