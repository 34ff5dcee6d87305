"""A megatron-core transformer layer built with the 3D layer spec (model/tp3d.py: Linear3D linears,
x-split layer norms, megatron-core's own attention on heads/gy) equals the single-process layer
(TP=1, same global weights) in float64: output, input gradient and every parameter gradient, on
five 4-rank grids, bias-free and with megatron-core's linear biases. One 4-rank spawn, ~45 s on the shared 2 cores: slow tier."""

import functools

import pytest

from workers.tp3d_workers import GRIDS, layer_cases


@functools.cache
def _results():
    from megatron_het.platform.local_launch import run_local

    return run_local(4, layer_cases, timeout_s=600)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("bias", [False, True], ids=["bias-free", "bias"])
@pytest.mark.parametrize("grid", GRIDS)
def test_3d_layer_equals_single_process_layer(grid, bias):
    for rank, res in enumerate(_results()):
        errs = res[bias][grid]
        # 4 linear weights (+ 4 biases), 2 norms x (weight, bias)
        assert {"y", "dx"} <= set(errs) and len(errs) == 2 + 8 + (4 if bias else 0)
        worst = max(errs, key=errs.get)
        assert errs[worst] < 1e-12, f"rank {rank} grid {grid}: {worst} off by {errs[worst]}"
