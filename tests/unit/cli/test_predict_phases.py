"""tools/predict.py --phases: each stage's allocation peak in every phase of a run against the
device's memory (perf/phase_memory.py), the check before a first GPU job."""

from __future__ import annotations

from pathlib import Path

from megatron_het.cli.predict import main

ROOT = Path(__file__).parents[3]
ARGS = ["--cluster", str(ROOT / "examples/clusters/h100-8.yaml"), "--model", str(ROOT / "examples/models/llama2-7b.yaml"),
        "--tp", "1", "--pp", "1", "--dp", "8", "--micro-batch-size", "1", "--global-batch-size", "64",
        "--use-distributed-optimizer", "--phases"]


def _rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("replica stage rank"))
    return [line.split() for line in lines[head + 1:] if line[:1].isdigit()]


def test_the_first_h100_job_fits_every_phase(capsys):
    assert main(ARGS) == 0
    out = capsys.readouterr().out
    assert "allocation peak of each phase" in out and "buckets of 40000000 parameters" in out
    (row,) = _rows(out)  # eight identical replicas: one row
    construction, forward_backward, reduce, step, save, load = map(float, row[3:9])
    assert forward_backward == max(construction, forward_backward, reduce, step, save, load)
    assert forward_backward < 80 and "DOES NOT FIT" not in out


def test_unfused_attention_and_bigger_buckets_show_where_it_breaks(capsys):
    assert main(ARGS + ["--attention", "unfused"]) == 0
    assert "DOES NOT FIT in: forward_backward" in capsys.readouterr().out  # s x s scores at 4k tokens
    assert main(ARGS) == 0
    small = float(_rows(capsys.readouterr().out)[0][5])
    assert main(ARGS + ["--ddp-bucket-size", "400000000"]) == 0
    big = float(_rows(capsys.readouterr().out)[0][5])
    assert big > small  # the reduction's buffers are one bucket's
