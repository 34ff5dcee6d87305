"""Bad inputs to tools/checkpoint/convert.py and pretrain_gpt.py's arguments (#21): damaged, foreign or
crafted checkpoints and flags are one line, exit 2, nothing written and no code run."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from bad_input_harness import CPU_DEMO, DEEP_JSON, DEMO_PLAN, GARBAGE, TINY, Row, check_row

from megatron_het.cli import convert as convert_cli

TORCH_DIST = '{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'


class _RunsCommand:
    """Unpickling this runs a shell command (the attack of #21): it would create ``pwned``."""

    def __reduce__(self):
        return (os.system, ("touch pwned",))


def _crafted(root: Path) -> None:
    it = root / "save" / "iter_0000001"
    it.mkdir(parents=True)
    (it / ".metadata").write_bytes(pickle.dumps(_RunsCommand()))
    (it / "metadata.json").write_text(TORCH_DIST)
    (root / "save" / "latest_checkpointed_iteration.txt").write_text("1")


def _real(root: Path) -> Path:
    """A real (tiny) torch_dist checkpoint under save/iter_0000001."""
    import torch.distributed.checkpoint as dcp

    it = root / "save" / "iter_0000001"
    blob = io.BytesIO()
    torch.save({"iteration": 1}, blob)
    dcp.save({"w": torch.zeros(256), "common": io.BytesIO(blob.getvalue())}, checkpoint_id=str(it), no_dist=True)
    (it / "metadata.json").write_text(TORCH_DIST)
    (root / "save" / "latest_checkpointed_iteration.txt").write_text("1")
    return it


def _truncated_metadata(root: Path) -> None:
    meta = _real(root) / ".metadata"
    meta.write_bytes(meta.read_bytes()[:40])


def _truncated_data(root: Path) -> None:
    data = next(_real(root).glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:64])


def _garbage_metadata(root: Path) -> None:
    it = _real(root)
    (it / ".metadata").write_bytes(GARBAGE)


def _hf(config: str | bytes, weights: bytes = GARBAGE):
    def setup(root: Path) -> None:
        hf = root / "hf"
        hf.mkdir()
        (hf / "config.json").write_bytes(config if isinstance(config, bytes) else config.encode())
        (hf / "model.safetensors").write_bytes(weights)
    return setup


LLAMA_CONFIG = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                           "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 64})


def het(inp: str = "save", out: str = "out", fmt: str = "het") -> tuple[str, ...]:
    return ("--input", inp, "--input-format", fmt, "--output", out, "--output-format", "hf")


CONVERT_ROWS = [
    Row(id="input-missing", argv=het(), names=("save",)),
    Row(id="input-is-file", argv=het(), files={"save": "x"}, names=("save",)),
    Row(id="format-typo", argv=("--input", "save", "--input-format", "hett", "--output", "out", "--output-format",
                                "hf"), dirs=("save",), names=("--input-format",)),
    Row(id="tp-not-int", argv=(*het(), "--tp", "two"), dirs=("save",), names=("--tp",)),
    Row(id="het-crafted-metadata", argv=het(), setup=_crafted, names=(".metadata",)),
    Row(id="megatron-crafted-metadata", argv=het(fmt="megatron"), setup=_crafted, names=(".metadata",)),
    Row(id="het-garbage-metadata", argv=het(), setup=_garbage_metadata, names=(".metadata",)),
    Row(id="het-truncated-metadata", argv=het(), setup=_truncated_metadata, names=(".metadata",)),
    Row(id="het-truncated-data", argv=het(), setup=_truncated_data, names=(".distcp",)),
    Row(id="het-tracker-garbage", argv=het(), files={"save/latest_checkpointed_iteration.txt": GARBAGE},
        names=("latest_checkpointed_iteration.txt",)),
    Row(id="het-tracker-points-nowhere", argv=het(), files={"save/latest_checkpointed_iteration.txt": "7"},
        names=("iter_0000007", "latest_checkpointed_iteration.txt")),
    Row(id="hf-config-garbage", argv=het("hf", fmt="hf"), setup=_hf(GARBAGE), names=("config.json",)),
    Row(id="hf-config-deep", argv=het("hf", fmt="hf"), setup=_hf(DEEP_JSON), names=("config.json",)),
    Row(id="hf-weights-garbage", argv=het("hf", fmt="hf"), setup=_hf(LLAMA_CONFIG), names=("model.safetensors",)),
    Row(id="output-not-empty", argv=het(), setup=_crafted, files={"out/keep.txt": "mine"}, names=("out",)),
    Row(id="output-under-file", argv=het(out="f.txt/out"), setup=_crafted, files={"f.txt": "x"},
        names=("f.txt",)),
    Row(id="model-non-utf8", argv=(*het(), "--model", "m.yaml"), setup=_crafted,
        files={"m.yaml": b"num_layers: \xff\n"}, names=("m.yaml",)),
]


@pytest.mark.parametrize("row", CONVERT_ROWS, ids=lambda r: r.id)
def test_convert_refuses(row, tmp_path, capsys, monkeypatch):
    check_row(convert_cli.main, row, tmp_path, capsys, monkeypatch)


BASE = ("--hetero-cluster", CPU_DEMO, "--hetero-plan", DEMO_PLAN, "--hetero-model", TINY,
        "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "1", "--lr", "1e-3")

PRETRAIN_ROWS = [
    Row(id="tokenizer-model-last", argv=(*BASE, "--data-path", "d", "--tokenizer-model"),
        names=("--tokenizer-model",)),
    Row(id="tokenizer-model-equals-missing", argv=(*BASE, "--data-path", "d", "--tokenizer-model=sp.model"),
        names=("sp.model",)),
    Row(id="tokenizer-model-garbage", argv=(*BASE, "--data-path", "d", "--tokenizer-model", "sp.model"),
        files={"sp.model": GARBAGE}, names=("sp.model",)),
    Row(id="micro-batch-not-int", argv=(*BASE[:6], "--micro-batch-size", "two", "--global-batch-size", "16",
                                        "--train-iters", "1", "--mock-data", "--lr", "1e-3"),
        names=("--micro-batch-size",)),
    Row(id="cluster-missing", argv=("--hetero-cluster", "c.yaml", *BASE[2:], "--mock-data"), names=("c.yaml",)),
    Row(id="plan-garbage", argv=(*BASE[:2], "--hetero-plan", "p.json", *BASE[4:], "--mock-data"),
        files={"p.json": GARBAGE}, names=("p.json",)),
]


@pytest.mark.parametrize("row", PRETRAIN_ROWS, ids=lambda r: r.id)
def test_pretrain_arguments_refused(row, tmp_path, capsys, monkeypatch):
    from megatron_het.cli import pretrain

    check_row(pretrain.main, row, tmp_path, capsys, monkeypatch)
