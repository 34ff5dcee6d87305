"""No code runs from a checkpoint (#21): crafted ``.metadata`` and byte items are refused before
torch or megatron-core unpickle them, by convert and by the loader ``pretrain_gpt.py --load`` uses;
damaged checkpoints are one CheckpointError naming the file."""

from __future__ import annotations

import io
import json
import os
import pickle

import pytest
import torch

from megatron_het.checkpoint.errors import CheckpointError
from megatron_het.checkpoint.safe_read import MetadataUnpickler, read_metadata, verify_checkpoint
from megatron_het.cluster import ModelSpec

MODEL = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=100)


class _RunsCommand:
    """Unpickling this runs a shell command (the attack of #21)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _payload(marker) -> bytes:
    return pickle.dumps(_RunsCommand(str(marker)))


def _dcp_save(path, state) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))


def _crafted_checkpoint(root, marker):
    """A het save directory (tracker + iter_0000001) whose .metadata would run a command."""
    it = root / "iter_0000001"
    it.mkdir(parents=True)
    (it / ".metadata").write_bytes(_payload(marker))
    (it / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    return it


def test_payload_is_live_with_plain_pickle(tmp_path):
    """The test payload really executes when unpickled normally (so the refusals below mean something)."""
    marker = tmp_path / "pwned"
    pickle.loads(_payload(marker))
    assert marker.exists()


def test_real_dcp_metadata_is_accepted(tmp_path):
    blob = io.BytesIO()
    torch.save({"iteration": 3, "model": {"num_layers": 2}}, blob)
    _dcp_save(tmp_path, {"w": torch.arange(6.0).reshape(2, 3), "common": io.BytesIO(blob.getvalue())})
    metadata = read_metadata(str(tmp_path))
    assert tuple(metadata.state_dict_metadata["w"].size) == (2, 3)
    verify_checkpoint(str(tmp_path))  # byte item loads weights-only: accepted


def test_unpickler_refuses_other_globals():
    for payload in (_payload("/nonexistent/x"), pickle.dumps(torch.nn.Linear), pickle.dumps(print)):
        with pytest.raises(pickle.UnpicklingError, match="not allowed"):
            MetadataUnpickler(io.BytesIO(payload)).load()


def test_crafted_metadata_refused_by_loader_and_convert(tmp_path, capsys):
    from megatron_het.checkpoint.dist_ckpt import load_checkpoint, read_common
    from megatron_het.cli.convert import main

    marker = tmp_path / "pwned"
    it = _crafted_checkpoint(tmp_path / "save", marker)
    with pytest.raises(CheckpointError, match=r"\.metadata: refused to load checkpoint metadata: global 'posix"):
        read_common(str(it))  # what pretrain_gpt.py --load reads first (padded vocabulary)
    with pytest.raises(CheckpointError, match=r"\.metadata: refused"):
        load_checkpoint(str(it), params={}, model=MODEL)
    for fmt in ("het", "megatron"):
        out = tmp_path / f"out-{fmt}"
        assert main(["--input", str(tmp_path / "save"), "--input-format", fmt, "--output", str(out),
                     "--output-format", "hf", "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and ".metadata: refused" in err[0] and "Fix:" in err[0], err
        assert not out.exists()
    assert not marker.exists()


def test_crafted_byte_item_refused(tmp_path):
    """A common-state object torch would load with weights_only=False (DefaultLoadPlanner.load_bytes)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    _dcp_save(ckpt, {"w": torch.zeros(2), "common": io.BytesIO(b"ok")})
    # Point the byte item at a raw pickle: torch.load(weights_only=False) would unpickle it.
    (ckpt / "evil.distcp").write_bytes(_payload(marker))
    metadata = read_metadata(str(ckpt))
    for index in metadata.storage_data:
        if index.fqn == "common":
            metadata.storage_data[index] = _StorageInfo("evil.distcp", 0, (ckpt / "evil.distcp").stat().st_size)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"evil\.distcp: object 'common': refused to load"):
        verify_checkpoint(str(ckpt))
    from megatron_het.checkpoint.dist_ckpt import read_common

    with pytest.raises(CheckpointError, match="refused to load"):
        read_common(str(ckpt))
    assert not marker.exists()


def test_damaged_checkpoints_name_the_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    _dcp_save(ckpt, {"w": torch.zeros(1000)})
    data = ckpt / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: truncated: \.metadata expects \d+ bytes, the file has 100"):
        verify_checkpoint(str(ckpt))
    data.unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: missing"):
        verify_checkpoint(str(ckpt))
    (ckpt / ".metadata").write_bytes((ckpt / ".metadata").read_bytes()[:50])
    with pytest.raises(CheckpointError, match=r"\.metadata: corrupt or truncated"):
        verify_checkpoint(str(ckpt))
    (ckpt / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata: missing"):
        verify_checkpoint(str(ckpt))
    (ckpt / "metadata.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(CheckpointError, match=r"metadata.json: not UTF-8 text \(byte 0\)\. Fix: copy the checkpoint again"):
        verify_checkpoint(str(ckpt))
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        verify_checkpoint(str(tmp_path / "nope"))
