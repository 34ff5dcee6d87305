"""tools/checkpoint/convert.py findings of a new-user review: --tp/--pp the model cannot be split by were
recorded in the output; "Fix:" texts that named flags convert.py does not have or the wrong remedy."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_het.checkpoint.convert import ModelState, expected_shapes, write_hf
from megatron_het.checkpoint.convert.het import write_het
from megatron_het.checkpoint.convert.io import atomic_output_dir
from megatron_het.cli import convert as convert_cli
from megatron_het.cluster import ModelSpec

GPT = ModelSpec(num_layers=4, hidden_size=16, num_attention_heads=4, seq_length=8, vocab_size=50)


def _state(model: ModelSpec = GPT) -> ModelState:
    g = torch.Generator().manual_seed(0)
    return ModelState(model=model, tensors={n: torch.randn(s, generator=g) for n, s in expected_shapes(model).items()})


def _hf_dir(root) -> str:
    src = str(root / "hf")
    with atomic_output_dir(src) as tmp:
        write_hf(_state(), tmp)
    return src


def _het_dir(root) -> str:
    src = str(root / "save")
    with atomic_output_dir(src) as tmp:
        write_het(_state(), tmp)
    return src


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(("flags", "needle", "fix"), [
    (["--tp", "3"], "--tp 3: tensor-parallel size 3 (number of ranks) does not divide num_attention_heads=4",
     "Fix: use a TP size that divides 4: one of [1, 2, 4]"),
    (["--pp", "7"], "--pp 7: exceeds the model's num_layers=4", "Fix: use a PP size that divides 4: one of [1, 2, 4]"),
    (["--pp", "3"], "--pp 3: does not divide the model's num_layers=4", "one of [1, 2, 4]"),
])
@pytest.mark.parametrize("fmt", ["het", "megatron"])
def test_parallel_sizes_the_model_cannot_take_are_refused(tmp_path, capsys, flags, needle, fix, fmt):
    src = _hf_dir(tmp_path)
    out = tmp_path / "out"
    rc = convert_cli.main(["--input", src, "--input-format", "hf", "--output", str(out), "--output-format", fmt,
                           "--no-progress", *flags])
    assert rc == 2
    line = _one_line(capsys)
    assert needle in line and fix in line, line
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["hf"]


def test_parallel_sizes_that_fit_are_accepted(tmp_path, capsys):
    src = _hf_dir(tmp_path)
    assert convert_cli.main(["--input", src, "--input-format", "hf", "--output", str(tmp_path / "out"),
                             "--output-format", "het", "--no-progress", "--tp", "2", "--pp", "2"]) == 0


@pytest.mark.parametrize("fmt", ["megatron", "hf"])
def test_het_checkpoint_read_as_another_format_names_input_format_het(tmp_path, capsys, fmt):
    src = _het_dir(tmp_path)
    rc = convert_cli.main(["--input", src, "--input-format", fmt, "--output", str(tmp_path / "out"),
                           "--output-format", "hf", "--no-progress"])
    assert rc == 2
    line = _one_line(capsys)
    assert "megatron-het checkpoint" in line and "Fix: pass --input-format het" in line, line
    assert "--model" not in line


def test_model_mismatch_fix_names_convert_flags_not_load(tmp_path, capsys):
    src = _het_dir(tmp_path)
    other = tmp_path / "other.yaml"
    other.write_text("num_layers: 4\nhidden_size: 32\nnum_attention_heads: 4\nseq_length: 8\nvocab_size: 50\n")
    rc = convert_cli.main(["--input", src, "--input-format", "het", "--model", str(other), "--output",
                           str(tmp_path / "out"), "--output-format", "hf", "--no-progress"])
    assert rc == 2
    line = _one_line(capsys)
    assert "hidden_size" in line and "--load" not in line and "Fix: drop --model" in line, line
