"""Read a checkpoint someone else wrote without running code from it: the one way in.

torch's distributed-checkpoint reader unpickles ``.metadata`` with plain ``pickle.load``
(``FileSystemReader.read_metadata``) and every byte item of the ``.distcp`` files (megatron-core's
common state, ``_extra_state``) with ``torch.load(weights_only=False)``
(``DefaultLoadPlanner.load_bytes``); megatron-core's ``dist_checkpointing`` gives no way to pass a
safer reader in. So every load in this project goes through the functions below, which first
verify the directory with restricted readers:

- ``.metadata`` through :class:`MetadataUnpickler`: only the dataclasses and enums of
  ``torch.distributed.checkpoint`` (metadata, planner items, filesystem storage info), ``torch.Size``,
  dtypes, layouts and a few plain builtins; any other global (``os.system``...) is refused;
- each byte item, and a legacy ``common.pt``, with ``torch.load(weights_only=True)`` (the safe globals
  megatron-core registers on import, e.g. ``argparse.Namespace``, are allowed);
- every storage entry must point inside the directory and inside its file (a truncated ``.distcp``
  is reported here, naming the file, instead of failing deep in torch).

Only then megatron-core reads the same files. A file swapped between the check and the read is out
of scope (whoever can write into the directory while it loads controls the run anyway).
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
from collections.abc import Mapping

import torch

import megatron_het.platform  # noqa: F401  (triton import guard before any megatron import)
from megatron_het.checkpoint.errors import CheckpointError
from megatron_het.platform import HOST_DEVICE
from megatron_het.utils.json_file import FileProblem, read_json_file

METADATA = ".metadata"  # torch DCP's global metadata file (pickled)
CONFIG = "metadata.json"  # megatron-core's marker of a distributed checkpoint
COMMON_PT = "common.pt"  # legacy megatron-core common state (torch.save)
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem")
_PLAIN = {("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
          ("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
          ("torch", "Size"), ("torch.serialization", "_get_layout")}
_FIX_UNTRUSTED = ("only load checkpoints from a source you trust; re-save or re-convert it from the original "
                  "weights with this project's tools")


class RefusedGlobal(pickle.UnpicklingError):
    """The metadata names a global outside the allow-list (what an attack needs)."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickler for DCP ``.metadata``: refuses every global but the checkpoint-metadata types."""

    def find_class(self, module: str, name: str):
        if (module, name) in _PLAIN:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        if module in _DCP_MODULES:
            obj = super().find_class(module, name)
            # Data types defined there (dataclasses, enums), not readers, planners or functions.
            if (isinstance(obj, type) and obj.__module__ == module
                    and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))):
                return obj
        raise RefusedGlobal(f"global '{module}.{name}' is not allowed in checkpoint metadata")


def read_metadata(path: str):
    """The DCP ``Metadata`` of checkpoint directory ``path``, read with :class:`MetadataUnpickler`."""
    from torch.distributed.checkpoint.metadata import Metadata

    file = os.path.join(path, METADATA)
    try:
        with open(file, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing (a torch_dist checkpoint directory has one). Fix: point at a "
                              f"complete iter_XXXXXXX directory; an interrupted save leaves none") from None
    except RefusedGlobal as e:
        raise CheckpointError(f"{file}: refused to load checkpoint metadata: {e}; unpickling it could run "
                              f"code. Fix: {_FIX_UNTRUSTED}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, MemoryError,
            UnicodeDecodeError, OSError) as e:
        raise CheckpointError(f"{file}: corrupt or truncated checkpoint metadata ({type(e).__name__}: {e}). "
                              f"Fix: copy the checkpoint again or use another iteration") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{file}: holds a {type(metadata).__name__}, not checkpoint metadata. "
                              f"Fix: {_FIX_UNTRUSTED}")
    return metadata


def _weights_only(data: bytes | str, what: str) -> None:
    """Refuse ``data`` (bytes or a file) unless ``torch.load(weights_only=True)`` accepts it."""
    import megatron.core  # noqa: F401  (registers megatron-core's safe globals, e.g. argparse.Namespace)

    try:
        torch.load(io.BytesIO(data) if isinstance(data, bytes) else data, map_location=HOST_DEVICE,
                   weights_only=True)  # a validity probe: read into host memory
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{what}: refused to load: {first}; unpickling it could run code. "
                              f"Fix: {_FIX_UNTRUSTED}") from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{what}: corrupt or truncated ({first}). "
                              f"Fix: copy the checkpoint again or use another iteration") from None


def _check_storage(path: str, metadata) -> None:
    """Every storage entry inside the directory and its file; byte items loadable weights-only."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    storage = metadata.storage_data
    if not isinstance(storage, Mapping):
        raise CheckpointError(f"{os.path.join(path, METADATA)}: no storage index. Fix: copy the checkpoint again")
    byte_keys = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or os.path.basename(rel) != rel or rel in ("", ".", ".."):
            raise CheckpointError(f"{os.path.join(path, METADATA)}: storage path {rel!r} is not a file of the "
                                  f"checkpoint directory. Fix: {_FIX_UNTRUSTED}")
        file = os.path.join(path, rel)
        if rel not in sizes:
            if not os.path.isfile(file):
                raise CheckpointError(f"{file}: missing (listed in {METADATA}). Fix: copy the whole checkpoint "
                                      f"directory again")
            sizes[rel] = os.path.getsize(file)
        end = int(info.offset) + int(info.length)
        if info.offset < 0 or info.length < 0 or end > sizes[rel]:
            raise CheckpointError(f"{file}: truncated: {METADATA} expects {end} bytes, the file has {sizes[rel]}. "
                                  f"Fix: copy the checkpoint again or use another iteration")
        if getattr(index, "fqn", None) in byte_keys:
            if info.transform_descriptors:
                raise CheckpointError(f"{file}: object {index.fqn!r} is stored with transforms "
                                      f"{list(info.transform_descriptors)}, which this build cannot verify. "
                                      f"Fix: re-save the checkpoint without compression")
            with open(file, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
            _weights_only(data, f"{file}: object {index.fqn!r}")


def verify_checkpoint(path: str) -> None:
    """Check a torch_dist checkpoint directory before megatron-core reads it (see the module doc)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory. Fix: check the path (--load / --input) "
                              f"and the tracker file")
    config = os.path.join(path, CONFIG)
    if not os.path.exists(config):
        raise CheckpointError(f"{config}: missing, so {path} is not a torch_dist checkpoint. Fix: point at an "
                              f"iter_XXXXXXX directory written by Megatron-LM or megatron-het")
    try:
        parsed = read_json_file(config)
    except FileProblem as e:
        raise CheckpointError(f"{config}: {e}. Fix: copy the checkpoint again") from None
    if not isinstance(parsed, dict):
        raise CheckpointError(f"{config}: expected a JSON object, found {type(parsed).__name__}. "
                              f"Fix: copy the checkpoint again")
    _check_storage(path, read_metadata(path))
    legacy = os.path.join(path, COMMON_PT)
    if os.path.exists(legacy):
        _weights_only(legacy, legacy)


def _failed(path: str, what: str, e: Exception) -> CheckpointError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return CheckpointError(f"{path}: could not read {what}: {first}. Fix: check that the directory is a complete "
                           f"checkpoint of this model (copy it again or use another iteration)")


def load_common_state(path: str) -> dict:
    """megatron-core's common (non-tensor) state of a verified checkpoint."""
    from megatron.core import dist_checkpointing

    verify_checkpoint(path)
    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception as e:  # after verification: damage torch/megatron-core found; name the directory
        raise _failed(path, "the common state", e) from e
    if not isinstance(common, dict):
        raise CheckpointError(f"{path}: common state is a {type(common).__name__}, not a dict. "
                              f"Fix: {_FIX_UNTRUSTED}")
    return common


def load_tensor_metadata(path: str) -> dict:
    """Key -> ShardedTensor (global shape and dtype only) of a verified checkpoint."""
    from megatron.core import dist_checkpointing

    verify_checkpoint(path)
    try:
        return dist_checkpointing.load_tensors_metadata(path)
    except Exception as e:  # after verification: damage torch/megatron-core found
        raise _failed(path, "the tensor index", e) from e


def load_sharded(request: Mapping, path: str, *, verified: bool = False) -> dict:
    """``dist_checkpointing.load`` of a verified checkpoint (access-integrity check off: ranks of
    different TP sizes read the same key with different grids). ``verified``: the caller verified
    ``path`` already (a streamed load reads it many times)."""
    from megatron.core import dist_checkpointing

    if not verified:
        verify_checkpoint(path)
    try:
        return dist_checkpointing.load(dict(request), path, validate_access_integrity=False)
    except Exception as e:  # shape mismatches and damage: name the directory
        raise _failed(path, "the requested tensors", e) from e
