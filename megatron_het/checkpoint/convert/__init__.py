"""Checkpoint conversion between megatron-het, Megatron-LM (torch_dist) and Hugging Face safetensors.

Every adapter reads into / writes from one neutral form (:class:`ModelState`: full tensors under
megatron-het's global names, unpadded vocabulary), so any pair of formats converts through it.
CLI: tools/checkpoint/convert.py. Guide: docs/checkpoint-conversion.md.
"""

from megatron_het.checkpoint.convert.convert import FORMATS, ConvertRequest, convert, read_state, write_state
from megatron_het.checkpoint.convert.errors import ConvertError
from megatron_het.checkpoint.convert.het import read_het, write_het
from megatron_het.checkpoint.convert.hf import from_hf, hf_config, model_from_hf_config, read_hf, to_hf, write_hf
from megatron_het.checkpoint.convert.megatron import (
    build_full_model,
    megatron_args,
    megatron_key,
    model_from_megatron_args,
    read_megatron,
    write_megatron,
)
from megatron_het.checkpoint.convert.qkv import fuse_qkv, split_qkv
from megatron_het.checkpoint.convert.state import ModelState, check_state, expected_shapes

__all__ = [
    "FORMATS",
    "ConvertError",
    "ConvertRequest",
    "ModelState",
    "build_full_model",
    "check_state",
    "convert",
    "expected_shapes",
    "from_hf",
    "fuse_qkv",
    "hf_config",
    "megatron_args",
    "megatron_key",
    "model_from_hf_config",
    "model_from_megatron_args",
    "read_het",
    "read_hf",
    "read_megatron",
    "read_state",
    "split_qkv",
    "to_hf",
    "write_het",
    "write_hf",
    "write_megatron",
    "write_state",
]
