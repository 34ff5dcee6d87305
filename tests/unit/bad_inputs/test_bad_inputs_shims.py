"""One bad input per tool through its tools/ shim in a real process (#21): the shim's exit code is the
CLI's, stderr is one line naming the file or flag, no traceback, nothing written. All run at once."""

from __future__ import annotations

import subprocess
import time

import pytest
from bad_input_harness import CPU_DEMO, DEMO_PLAN, ROW_LIMIT_S, TINY, error_line, shim_command, snapshot

from support.paths import REPO

# tool (path under tools/ or the repository) -> (arguments, what the error must name)
SMOKE = {
    "plan.py": (("--cluster", "nope.yaml", "--model", TINY, "--global-batch-size", "16"), "nope.yaml"),
    "predict.py": (("--cluster", CPU_DEMO, "--model", TINY, "--plan", DEMO_PLAN, "--tp", "2"), "--tp"),
    "profile_host.py": (("--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
                         "--output", "no/such/p.json"), "no/such/p.json"),
    "slurm.py": (("--cluster", "nope.yaml", "--plan", DEMO_PLAN, "--model", TINY), "nope.yaml"),
    "cluster.py": (("show", "nope.yaml"), "nope.yaml"),
    "checkpoint/convert.py": (("--input", "nope", "--input-format", "het", "--output", "out", "--output-format",
                               "hf"), "nope"),
    "preprocess_data.py": (("--input", "nope.jsonl", "--output-prefix", "out", "--tokenizer-model", "sp.model"),
                           "nope.jsonl"),
    "train_tokenizer.py": (("--input", "nope.jsonl", "--output-prefix", "sp"), "nope.jsonl"),
    "make_corpus.py": (("--output", "c.jsonl", "--stdlib-dir", "nolib"), "nolib"),
    "../pretrain_scripts/pretrain_gpt.py": (("--hetero-cluster", CPU_DEMO, "--hetero-plan", DEMO_PLAN,
                                             "--hetero-model", TINY, "--micro-batch-size", "2",
                                             "--global-batch-size", "16", "--data-path", "d",
                                             "--tokenizer-model"), "--tokenizer-model"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[int, str, float, bool]]:
    """Every shim started at once (2 cores: sequential imports would cost a minute), each in its own cwd."""
    started = {}
    for tool, (argv, _) in SMOKE.items():
        cwd = tmp_path_factory.mktemp(tool.replace("/", "_").replace(".", "_"))
        before = snapshot(cwd)
        proc = subprocess.Popen(shim_command(tool, *argv), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        started[tool] = (proc, cwd, before, time.monotonic())
    results = {}
    for tool, (proc, cwd, before, start) in started.items():
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        results[tool] = (proc.returncode, err, time.monotonic() - start, snapshot(cwd) == before)
    return results


@pytest.mark.parametrize("tool", list(SMOKE), ids=lambda t: t.rsplit("/", 1)[-1])
def test_shim_reports_bad_input_in_one_line(tool, runs):
    code, err, elapsed, unchanged = runs[tool]
    assert "Traceback" not in err, err
    assert code == 2, f"exit code {code}, stderr:\n{err}"
    assert SMOKE[tool][1] in error_line(err)
    assert unchanged, "the working directory changed"
    # all shims share 2 cores; the 10 s bound per input holds with the imports of a lone process
    assert elapsed < 6 * ROW_LIMIT_S, f"took {elapsed:.1f} s"


def test_shims_exist():
    for tool in SMOKE:
        assert (REPO / "tools" / tool).is_file(), tool
