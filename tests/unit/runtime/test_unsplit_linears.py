"""runtime/split_backward.unsplit_linears: the linears a split-backward schedule cannot defer.

install_split_linears routes megatron-core's local ColumnParallelLinear/RowParallelLinear through the
weight-gradient store; transformer-engine's linears (the GPU default where TE is installed) are not, so
their W stays in B and the trainer says so at start-up. Checked on stand-in modules named like TE's."""

from __future__ import annotations

import torch

from megatron_het.runtime.split_backward import unsplit_linears


class TELayerNormColumnParallelLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 3))


class LayerNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))


def test_routed_and_non_linear_modules_are_not_reported():
    model = torch.nn.Module()
    model.qkv = TELayerNormColumnParallelLinear()
    model.out = TELayerNormColumnParallelLinear()
    model.norm = LayerNorm()
    assert unsplit_linears(model, ["out"]) == ["qkv"]
    assert unsplit_linears(model, ["qkv", "out"]) == []
