"""Rank functions for the overlap and 3D tensor-parallel tests (module-level for spawn; no tests).

Every case builds full float64 tensors from a seed on every rank, runs the distributed layer on
this rank's blocks, and returns the largest absolute difference to a single-process
``torch.nn.functional.linear`` on the full tensors (forward output, input gradient, weight
gradient), so the parent asserts on concrete numbers.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _full(seed: int, *shape: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _reference(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor):
    """Single-process ``y = x @ w^T`` with loss ``sum(y * g)``: returns (y, dx, dw)."""
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    y = F.linear(x, w)
    (y * g).sum().backward()
    return y.detach(), x.grad, w.grad


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max())


def _column_case(group, s, b, h, n, chunks, overlap, dtype, seed):
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    x, w, g = _full(seed, s, b, h), _full(seed + 1, n, h), _full(seed + 2, s, b, n)
    y, dx, dw = _reference(x, w, g)
    from megatron_het.comm.overlap import all_gather_linear

    sl, nl = s // tp, n // tp
    xs = x[r * sl:(r + 1) * sl].to(dtype).requires_grad_(True)
    ws = w[r * nl:(r + 1) * nl].to(dtype).requires_grad_(True)
    out = all_gather_linear(xs, ws, group=group, chunks=chunks, overlap=overlap)
    (out * g[..., r * nl:(r + 1) * nl].to(dtype)).sum().backward()
    return {"y": _err(out.detach(), y[..., r * nl:(r + 1) * nl]), "dx": _err(xs.grad, dx[r * sl:(r + 1) * sl]),
            "dw": _err(ws.grad, dw[r * nl:(r + 1) * nl])}


def _row_case(group, s, b, k, n, chunks, overlap, dtype, seed):
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    x, w, g = _full(seed, s, b, k), _full(seed + 1, n, k), _full(seed + 2, s, b, n)
    y, dx, dw = _reference(x, w, g)
    from megatron_het.comm.overlap import linear_reduce_scatter

    sl, kl = s // tp, k // tp
    xs = x[..., r * kl:(r + 1) * kl].to(dtype).requires_grad_(True)
    ws = w[:, r * kl:(r + 1) * kl].to(dtype).requires_grad_(True)
    out = linear_reduce_scatter(xs, ws, group=group, chunks=chunks, overlap=overlap)
    (out * g[r * sl:(r + 1) * sl].to(dtype)).sum().backward()
    return {"y": _err(out.detach(), y[r * sl:(r + 1) * sl]), "dx": _err(xs.grad, dx[..., r * kl:(r + 1) * kl]),
            "dw": _err(ws.grad, dw[:, r * kl:(r + 1) * kl])}


# (name, s, b, in, out, chunks, overlap, dtype); in and out are multiples of 4 (both layers, tp=4)
OVERLAP_CASES = (
    ("c1", 8, 2, 8, 8, 1, True, torch.float64),
    ("c2", 8, 2, 8, 8, 2, True, torch.float64),
    ("c4", 16, 3, 12, 12, 4, True, torch.float64),
    ("c3_of_4rows", 16, 1, 4, 4, 3, True, torch.float64),  # 4-row shard at tp=4: 2 pieces
    ("c2_blocking", 8, 2, 8, 8, 2, False, torch.float64),
    ("c4_fp32", 16, 2, 32, 16, 4, True, torch.float32),
)


def overlap_layers_cases(rank: int, world: int) -> dict:
    """World of 4: each case at tp=4 (world) and tp=2 (groups {0,1} and {2,3})."""
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    out = {}
    for tp_name, group in (("tp4", None), ("tp2", pair)):
        for i, (name, s, b, kin, n, chunks, overlap, dtype) in enumerate(OVERLAP_CASES):
            out[("column", tp_name, name)] = _column_case(group, s, b, kin, n, chunks, overlap, dtype, 10 * i)
            out[("row", tp_name, name)] = _row_case(group, s, b, kin, n, chunks, overlap, dtype, 10 * i + 5)
    out["grad_sync"] = grad_sync_case(rank, world)
    return out


# ---------------------------------------------------------------------------------------------
# 3D tensor parallelism

def _linear3d_case(groups, m, b, k, n, transpose, seed, chunks=4, overlap=True):
    from megatron_het.tp import Linear3D, rows_of

    data = groups.coords["data"]
    x, w, g = _full(seed + data, m, b, k), _full(seed + 100, n, k), _full(seed + 200 + data, m, b, n)
    y, dx, dw = _reference(x, w, g)
    layer = Linear3D(k, n, groups=groups, transpose=transpose, full_weight=w, dtype=torch.float64, chunks=chunks,
                     overlap=overlap)
    rows, fin, fout = rows_of(m, groups), layer.blocks["input_features"][0], layer.blocks["output_features"][0]
    xs = x[rows][..., fin].clone().requires_grad_(True)
    out = layer(xs)
    (out * g[rows][..., fout]).sum().backward()
    return {"y": _err(out.detach(), y[rows][..., fout]), "dx": _err(xs.grad, dx[rows][..., fin]),
            "dw": _err(layer.weight.grad, dw[layer.blocks["weight"]])}


def _mlp3d_case(groups, m, k, f, seed, chunks=4, overlap=True):
    """Normal then transposed layer, no redistribution in between; against y = (x W1^T) W2^T."""
    from megatron_het.tp import Linear3D, rows_of

    x, w1, w2, g = _full(seed, m, k), _full(seed + 1, f, k), _full(seed + 2, k, f), _full(seed + 3, m, k)
    xr, w1r, w2r = (t.clone().requires_grad_(True) for t in (x, w1, w2))
    (F.linear(F.linear(xr, w1r), w2r) * g).sum().backward()
    y_ref = F.linear(F.linear(x, w1), w2)
    kw = {"dtype": torch.float64, "chunks": chunks, "overlap": overlap}
    l1 = Linear3D(k, f, groups=groups, full_weight=w1, **kw)
    l2 = Linear3D(f, k, groups=groups, transpose=True, full_weight=w2, **kw)
    rows, fin, fout = rows_of(m, groups), l1.blocks["input_features"][0], l2.blocks["output_features"][0]
    xs = x[rows][..., fin].clone().requires_grad_(True)
    out = l2(l1(xs))
    (out * g[rows][..., fout]).sum().backward()
    return {"y": _err(out.detach(), y_ref[rows][..., fout]), "dx": _err(xs.grad, xr.grad[rows][..., fin]),
            "dw1": _err(l1.weight.grad, w1r.grad[l1.blocks["weight"]]),
            "dw2": _err(l2.weight.grad, w2r.grad[l2.blocks["weight"]])}


# (x, y, z, data)
GRIDS_3D = ((2, 1, 1, 2), (1, 2, 1, 2), (2, 2, 1, 1), (2, 1, 2, 1), (1, 2, 2, 1), (1, 1, 4, 1), (4, 1, 1, 1))
SHAPES_3D = ((8, 2, 12, 8), (4, 1, 4, 16))  # (rows, batch, in, out)
# (chunks, overlap): overlapped chunked collectives, the same chunks blocking, the plain layer
VARIANTS_3D = ((4, True), (4, False), (1, False))


def linear3d_cases(rank: int, world: int) -> dict:
    from megatron_het.tp import Grid4D, create_grid_groups

    out = {}
    for gi, (gx, gy, gz, gd) in enumerate(GRIDS_3D):
        grid = create_grid_groups(Grid4D(x=gx, y=gy, z=gz, data=gd))  # groups made once per grid
        for si, (m, b, k, n) in enumerate(SHAPES_3D):
            for transpose in (False, True):
                for chunks, overlap in VARIANTS_3D:
                    out[((gx, gy, gz, gd), (m, b, k, n), transpose, chunks, overlap)] = _linear3d_case(
                        grid, m, b, k, n, transpose, 1000 * gi + 10 * si, chunks, overlap)
        for chunks, overlap in VARIANTS_3D:
            out[("mlp", (gx, gy, gz, gd), chunks, overlap)] = _mlp3d_case(grid, 8, 8, 16, 7000 + gi, chunks, overlap)
    return out


# ---------------------------------------------------------------------------------------------
# Data-parallel gradient reduction overlapped with backward

def grad_sync_case(rank: int, world: int) -> dict:
    """World of 4: replica A at TP=2 (ranks 0,1), replicas B and C at TP=1 (ranks 2, 3).

    A partitioned weight (reshard path: TP sizes differ), a replicated bias, and a parameter held
    by B and C only (direct path). Gradients come from a real backward so the hooks fire.
    """
    from megatron_het.runtime.grad_sync import GradientSynchronizer, Holding
    from megatron_het.runtime.overlap_grad import OverlappedGradientSynchronizer

    tp_size, tp_rank, stage = (2, rank, (0, 0)) if rank < 2 else (1, 0, (rank - 1, 0))
    full = {"w": (6, 4), "bias": (4,), "only_bc": (3,)}
    local = [Holding(name="w", rank=rank, stage_key=stage, tp_rank=tp_rank, tp_size=tp_size, partition_dim=0,
                     full_shape=full["w"]),
             Holding(name="bias", rank=rank, stage_key=stage, tp_rank=tp_rank, tp_size=tp_size, partition_dim=None,
                     full_shape=full["bias"])]
    if rank >= 2:
        local.append(Holding(name="only_bc", rank=rank, stage_key=stage, tp_rank=0, tp_size=1, partition_dim=None,
                             full_shape=full["only_bc"]))

    def make_params():
        ps = {}
        for h in local:
            t = _full(5, *h.full_shape, dtype=torch.float32)
            if h.partition_dim is not None:
                t = torch.chunk(t, h.tp_size, dim=h.partition_dim)[h.tp_rank]
            ps[h.name] = torch.nn.Parameter(t.clone())
        return ps

    def backward(ps, micro):
        loss = sum((p * _full(100 * rank + 10 * micro + i, *p.shape, dtype=torch.float32)).sum()
                   for i, p in enumerate(ps.values()))
        loss.backward()

    plain_params, over_params = make_params(), make_params()
    plain = GradientSynchronizer(local, plain_params)
    over = OverlappedGradientSynchronizer(local, over_params)
    for micro in range(2):
        backward(plain_params, micro)
    plain.reduce()
    for micro in range(2):  # two micro-batches: only the last one's backward launches buckets
        if micro == 1:
            over.arm()
        backward(over_params, micro)
    launched = over.launched_in_backward
    over.reduce()
    errs = {n: _err(over_params[n].grad, plain_params[n].grad) for n in plain_params}
    # Second step without arm(): everything in reduce(), like the parent.
    for ps in (plain_params, over_params):
        for p in ps.values():
            p.grad = None
    backward(plain_params, 5)
    plain.reduce()
    backward(over_params, 5)
    over.reduce()
    errs_unarmed = {n: _err(over_params[n].grad, plain_params[n].grad) for n in plain_params}
    return {"launched_in_backward": launched, "buckets": len(over._groups), "errs": errs,
            "errs_unarmed": errs_unarmed, "w_grad": over_params["w"].grad.clone()}


# ---------------------------------------------------------------------------------------------
# megatron-core parity (2 ranks, TP=2, sequence parallelism)

def megatron_parity_cases(rank: int, world: int) -> dict:
    from megatron_het.platform import enable_cpu_backend

    enable_cpu_backend()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_het.cluster import ModelSpec
    from megatron_het.comm.overlap_megatron import apply_tp_comm_overlap
    from megatron_het.model.gpt import StageModelSpec, transformer_config
    from megatron_het.model.groups import BlockShape, block_process_groups
    from megatron_het.perf.flops import padded_vocab_size
    from megatron_het.tp.spec import sequence_parallel_block_spec

    _, pgc = block_process_groups(BlockShape(tp=2, pp=1, dp=1))
    out = {"layers": _megatron_layer_parity(pgc.tp)}
    for swiglu in (False, True):
        model = ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100,
                          swiglu=swiglu)
        spec = StageModelSpec(model=model, num_layers=2, layer_offset=0, tp=2, pre_process=True,
                              post_process=True, vocab_size=padded_vocab_size(100, tp=2), sequence_parallel=True)

        def build():
            torch.manual_seed(3)
            model_parallel_cuda_manual_seed(3, tp_rank=pgc.tp.rank(), ep_rank=0, etp_rank=0)
            # build_gpt_stage's arguments, with the sequence-parallel-capable local spec
            return GPTModel(config=transformer_config(spec), vocab_size=spec.vocab_size,
                            transformer_layer_spec=sequence_parallel_block_spec(
                                [get_gpt_layer_local_spec(normalization="RMSNorm" if swiglu else "LayerNorm")]
                                * spec.num_layers),
                            max_sequence_length=16, pre_process=True, post_process=True,
                            share_embeddings_and_output_weights=True,
                            position_embedding_type="learned_absolute",  # rope: not CPU-ready upstream
                            pg_collection=pgc)

        base, over = build(), build()
        report = apply_tp_comm_overlap(over, chunks=4)
        tokens = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(9))
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        pos = torch.arange(16).unsqueeze(0).expand(2, 16).contiguous()
        losses = []
        for m in (base, over):
            loss = m(inputs, pos, None, labels=labels).float().mean()
            loss.backward()
            losses.append(float(loss.detach()))
        grads = {n: _err(p1.grad, p2.grad) for (n, p1), (_, p2) in zip(base.named_parameters(),
                                                                       over.named_parameters())}
        out[("gpt", swiglu)] = {"loss": losses, "grad_err": max(grads.values()), "overlapped": report.overlapped,
                                "skipped": report.skipped}
    return out


def _megatron_layer_parity(tp_group) -> dict:
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_het.comm.overlap_megatron import apply_tp_comm_overlap

    cfg = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, use_cpu_initialization=True,
                              params_dtype=torch.float64)
    init = torch.nn.init.normal_
    out = {}
    for chunks in (1, 2, 4):
        for kind in ("column", "row"):
            mods = []
            for _ in range(2):
                torch.manual_seed(1)
                if kind == "column":
                    mods.append(ColumnParallelLinear(6, 8, config=cfg, init_method=init, bias=True,
                                                     tp_group=tp_group))
                else:
                    mods.append(RowParallelLinear(8, 6, config=cfg, init_method=init, bias=True,
                                                  input_is_parallel=True, skip_bias_add=False, tp_group=tp_group))
            apply_tp_comm_overlap(mods[1], chunks=chunks)
            shape = (4, 3, 6) if kind == "column" else (8, 3, 4)  # column: seq shard; row: full seq, in/2
            x = _full(40 + tp_group.rank(), *shape)
            res = []
            for m in mods:
                xi = x.clone().requires_grad_(True)
                y, _ = m(xi)
                (y * _full(50, *y.shape)).sum().backward()
                res.append((y.detach(), xi.grad, m.weight.grad, m.bias.grad))
            out[(kind, chunks)] = [_err(a, b) for a, b in zip(*res)]
    return out


# ---------------------------------------------------------------------------------------------
# One 4-rank spawn for every pure-torch case (a spawn costs ~10-20 s of imports on 2 cores).

def pure_cases(rank: int, world: int) -> dict:
    return {"overlap": overlap_layers_cases(rank, world), "linear3d": linear3d_cases(rank, world)}


@functools.cache
def _pure_run() -> tuple[list | None, str | None]:
    from megatron_het.platform.local_launch import run_local

    try:
        return run_local(4, pure_cases, timeout_s=600), None
    except Exception as exc:  # cached too: a failed spawn must not be repeated by every test
        return None, f"{type(exc).__name__}: {exc}"


def pure_results() -> list:
    """Per-rank results of ``pure_cases``, computed once per pytest process for all test files."""
    results, error = _pure_run()
    if error is not None:
        raise RuntimeError(f"the 4-rank spawn failed (once, cached): {error}")
    return results


def launch_order_worker(rank, world_size, count):
    """``count`` one-tensor buckets over both ranks (one shared group); rank 0's hooks complete them in
    the reverse of bucket order, rank 1's in bucket order. Returns (launch order, summed grads)."""
    import torch

    from megatron_het.platform import HOST_DEVICE, Accelerator, enable_cpu_backend
    from megatron_het.runtime.grad_sync import Holding
    from megatron_het.runtime.overlap_grad import OverlappedGradientSynchronizer

    enable_cpu_backend()
    acc = Accelerator(kind="cpu", device_count=0, torch_backend="gloo", device_name="cpu", device=HOST_DEVICE)
    names = [f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(count)]
    params = {n: torch.nn.Parameter(torch.zeros(4, 4)) for n in names}
    local = [Holding(name=n, rank=rank, stage_key=(rank, 0), tp_rank=0, tp_size=1, partition_dim=None,
                     full_shape=(4, 4)) for n in names]
    sync = OverlappedGradientSynchronizer(local, params, bucket_numel=16, accelerator=acc)
    launched = []
    real = sync._launch
    sync._launch = lambda i: (launched.append(i), real(i))
    sync.arm()
    bucket_of = {sync._groups[i][0].names[0]: i for i in range(len(sync._groups))}
    for name in sorted(names, key=lambda n: bucket_of[n], reverse=rank == 0):
        params[name].grad = torch.full((4, 4), float((1 + bucket_of[name]) * (1 if rank == 0 else 100)))
        sync._hook(name)(params[name])
    in_backward = sync.launched_in_backward
    sync.reduce()
    return launched, in_backward, len({id(g) for _, g in sync._groups}), {
        bucket_of[n]: float(params[n].grad[0, 0]) for n in names}


def interleaved_overlap_worker(rank, world_size, model, cases):
    """Fresh runs of (name, plan, train) cases: per case the losses and, on this rank, (buckets
    launched during the last backward, buckets) of the overlapped reducer (None without one)."""
    import torch.distributed as dist

    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    from workers.megatron_workers import batch_fn

    enable_cpu_backend()
    out = {}
    for name, plan, train in cases:
        dist.barrier()
        trainer = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batch_fn(model, train.seed))
        res = trainer.run()
        sync = trainer.strategy.sync
        launched = getattr(sync, "launched_in_backward", None)
        out[name] = {"losses": [log.lm_loss for log in res.iterations],
                     "launched": None if launched is None else (launched, len(sync._groups))}
        trainer.close()
    return out
