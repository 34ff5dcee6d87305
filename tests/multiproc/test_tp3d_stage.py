"""A whole GPT stage whose layers are 3D tensor-parallel (model/tp3d_stage.py: megatron-core GPTModel at
TP = gy, first layer slicing its input to the rank's [s, b/gz, h/gx] block, last layer gathering it
back) equals the single-process TP=1 GPTModel with the same global weights in float64: per-token
losses and the gradient of every parameter (embedding, position embedding, 3D linears, norms and
biases after the z sum, final norm), on three 4-rank grids. Tolerance: 1e-12 where gy = 1; where
gy > 1 megatron-core's vocab-parallel cross entropy runs in fp32 (measured: 4.8e-7 on per-token
losses of about 5, 1.3e-8 on the embedding gradient), so 1e-6 on losses and 1e-7 on gradients --
forgetting the z sum of norms and biases misses by 3e-2. One 4-rank spawn, ~10 s: slow tier."""

import functools

import pytest

from workers.tp3d_stage_workers import GRIDS, LAYERS, stage_cases


@functools.cache
def _results():
    from megatron_het.platform.local_launch import run_local

    return run_local(4, stage_cases, timeout_s=600)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("grid", GRIDS)
def test_3d_stage_equals_single_process_gpt(grid):
    for rank, res in enumerate(_results()):
        r = res[grid]
        errs, kinds = r["errs"], r["kinds"]
        # per layer: 4 linear weights + 4 biases, 2 norms x (weight, bias); embedding, position
        # embedding, final norm weight and bias (tied output layer)
        assert sum(k == "weight" for k in kinds.values()) == 4 * LAYERS
        assert sum(k == "norm" for k in kinds.values()) == 4 * LAYERS
        assert sum(k == "bias" for k in kinds.values()) == 4 * LAYERS
        assert len(errs) == 1 + 12 * LAYERS + 4, sorted(errs)
        loss_tol, grad_tol = (1e-12, 1e-12) if grid[1] == 1 else (1e-6, 1e-7)
        assert errs["loss"] < loss_tol, f"rank {rank} grid {grid}: per-token loss off by {errs['loss']}"
        grads = {k: v for k, v in errs.items() if k != "loss"}
        worst = max(grads, key=grads.get)
        assert grads[worst] < grad_tol, f"rank {rank} grid {grid}: {worst} gradient off by {grads[worst]}"
