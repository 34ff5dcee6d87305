"""Megatron's --transformer-impl (issue 14): local spec on CPU; transformer_engine refused where TE
cannot be used (here: no GPU), naming the flag and the fix."""

from __future__ import annotations

import pytest

from megatron_het.cluster import ModelSpec
from megatron_het.model.gpt import TransformerImplError, layer_spec
from megatron_het.runtime.arguments import parse_args

from support.paths import EXAMPLES

MODEL = ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100)


def test_flag_reaches_the_config():
    base = ["--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--hetero-cluster", str(EXAMPLES / "clusters" / "cpu-demo.yaml"), "--hetero-plan", "auto",
            "--hetero-model", str(EXAMPLES / "models" / "tiny-cpu.yaml"), "--mock-data"]
    assert parse_args(base).train.transformer_impl is None
    assert parse_args([*base, "--transformer-impl", "local"]).train.transformer_impl == "local"
    with pytest.raises(SystemExit):  # argparse names the flag and exits 2
        parse_args([*base, "--transformer-impl", "apex"])


def test_te_without_a_gpu_is_refused_when_parsing(capsys):
    """Before any rendezvous, once: not in every rank's model build after the process groups exist."""
    base = ["--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--hetero-cluster", str(EXAMPLES / "clusters" / "cpu-demo.yaml"), "--hetero-plan", "auto",
            "--hetero-model", str(EXAMPLES / "models" / "tiny-cpu.yaml"), "--mock-data"]
    with pytest.raises(SystemExit) as exc:
        parse_args([*base, "--transformer-impl", "transformer_engine"])
    assert exc.value.code == 2
    assert ("--transformer-impl transformer_engine: transformer-engine is not importable on a GPU in this process. "
            "Fix: pass --transformer-impl local") in capsys.readouterr().err


def test_local_spec_and_te_refused_without_a_gpu():
    local = layer_spec(MODEL, transformer_impl="local")
    default = layer_spec(MODEL)
    assert type(local) is type(default) and "transformer_engine" not in repr(local.submodules.self_attention)
    with pytest.raises(TransformerImplError, match="--transformer-impl transformer_engine.*Fix: pass --transformer-impl local"):
        layer_spec(MODEL, transformer_impl="transformer_engine")
