"""A tf32 plan asks torch for TF32 matmuls; other plans leave torch's fp32 default alone."""

from __future__ import annotations

import pytest
import torch

from megatron_het.platform.matmul_precision import apply_fp32_matmul, fp32_matmul_setting


@pytest.mark.parametrize("precision,setting", [("tf32", "tf32"), ("fp32", None), ("bf16", None), ("fp16", None),
                                               (None, None)])
def test_only_a_tf32_plan_changes_the_fp32_matmul_setting(precision, setting):
    assert fp32_matmul_setting(precision) == setting


@pytest.fixture
def restore_matmul_settings():
    saved = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved


def test_a_tf32_plan_sets_torchs_flags_and_says_so(restore_matmul_settings):
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    line = apply_fp32_matmul("tf32", is_gpu=True)
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    assert "TF32" in line and "tensor cores" in line
    assert "the host has none" in apply_fp32_matmul("tf32", is_gpu=False)


def test_an_fp32_plan_leaves_torchs_flags_untouched(restore_matmul_settings):
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    assert "torch's default" in apply_fp32_matmul("fp32", is_gpu=True)
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
