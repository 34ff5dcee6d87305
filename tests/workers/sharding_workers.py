"""Rank functions for the sharding tests (module-level so spawn can import them; no tests here)."""

from __future__ import annotations

import os

from megatron_het.cluster import ModelSpec
from megatron_het.train.config import TrainConfig

from workers.megatron_workers import batch_fn


def sharded_cases_worker(rank, world_size, model: ModelSpec, cases, train: TrainConfig, init_full_state,
                         padded_vocab, workdir):
    """Run several cases in one spawn. A case is a dict with "name", "kind" and its arguments:

    - kind "train": {"plan"}: train.train_iters iterations from init_full_state;
    - kind "resume": {"plan", "resume_plan", "split"}: ``split`` iterations under ``plan``, save,
      then a fresh trainer under ``resume_plan`` (no initial weights) loads and finishes;
    - kind "budget": {"plan", "budgets"}: construct with memory budgets; returns the error text or "ok".
    - kind "collectives": uneven all-gather / reduce-scatter of known values, every method.
    """
    import torch.distributed as dist

    from megatron_het.cluster import cluster_from_dict
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.sharding.budget import MemoryBudgetError
    from megatron_het.sharding.trainer import ShardedTrainer

    enable_cpu_backend()
    out = {}
    fn = batch_fn(model, train.seed)
    for case in cases:
        name, kind = case["name"], case["kind"]
        dist.barrier()
        if kind == "train":
            trainer = ShardedTrainer(model=model, plan=case["plan"], train=train, batch_fn=fn,
                                     init_full_state=init_full_state, padded_vocab=padded_vocab,
                                     slowdown=case.get("slowdown", [1.0] * world_size)[rank],
                                     gather_method=case.get("gather", "padded"),
                                     reduce_scatter_method=case.get("reduce_scatter", "reduce"),
                                     cluster=cluster_from_dict(case["cluster"]) if "cluster" in case else None)
            out[name] = trainer.run(return_shards=True)
            bridge = trainer.strategy.bridge
            out[("bridge_bytes", name)] = bridge.bridge_bytes() if bridge is not None else None
        elif kind == "resume":
            first = ShardedTrainer(model=model, plan=case["plan"], train=train, batch_fn=fn,
                                   init_full_state=init_full_state, padded_vocab=padded_vocab)
            a = first.run(case["split"])
            path = first.save_checkpoint(os.path.join(workdir, name))  # -> <dir>/iter_0000003
            second = ShardedTrainer(model=model, plan=case["resume_plan"], train=train, batch_fn=fn,
                                    padded_vocab=padded_vocab)
            loaded = second.load_checkpoint(path)
            b = second.run(train.train_iters - loaded, return_shards=True)
            out[name] = (a, b, loaded)
        elif kind == "budget":
            try:
                ShardedTrainer(model=model, plan=case["plan"], train=train, batch_fn=fn,
                               init_full_state=init_full_state, padded_vocab=padded_vocab,
                               memory_budget_bytes=case["budgets"])
                out[name] = "ok"
            except MemoryBudgetError as err:
                out[name] = str(err)
        elif kind == "collectives":
            out[name] = _collectives(rank, world_size, case["sizes"])
        else:
            raise ValueError(f"unknown case kind {kind!r}")
    return out


def _collectives(rank, world_size, sizes):
    import torch

    from megatron_het.sharding.collectives import uneven_all_gather, uneven_reduce_scatter
    from megatron_het.sharding.layout import ShardLayout

    layout = ShardLayout(sizes=tuple(sizes))
    start, stop = layout.range(rank)
    res = {}
    for method in ("padded", "broadcast"):
        shard = torch.arange(start, stop, dtype=torch.float32) * (rank + 1)
        res[f"gather_{method}"] = uneven_all_gather(shard, layout, method=method)
    # the reduce-scatter over the given layout, equal shards (reduce_scatter_tensor) and one empty shard
    for tag, rs_sizes in (("", tuple(sizes)), ("equal_", (2,) * world_size), ("empty_", (0,) + tuple(sizes[1:]))):
        rs_layout = ShardLayout(sizes=rs_sizes)
        full = torch.arange(rs_layout.numel, dtype=torch.float32) + 100 * rank  # differs per rank
        for method in ("native", "reduce", "all_reduce"):
            before = full.clone()
            res[f"{tag}rs_{method}"] = uneven_reduce_scatter(full, rs_layout, method=method)
            res[f"{tag}rs_{method}_unchanged"] = bool((full == before).all())
    # on gloo "native" runs the per-owner reduces (gloo's reduce-scatter all-reduces underneath): it must
    # not call dist.reduce_scatter at all
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("gloo's reduce-scatter was called (twice the bytes of the per-owner reduces)")

    full = torch.arange(layout.numel, dtype=torch.float32) + 100 * rank
    real, dist.reduce_scatter = dist.reduce_scatter, refuse
    try:
        res["gloo_rs_native"] = uneven_reduce_scatter(full, layout, method="native")
    finally:
        dist.reduce_scatter = real
    return res


def pretrain_sharded_worker(rank, world_size, steps, pipeline_check):
    """pretrain_gpt.py's sharded path, run in-process: ``steps`` is a list of (argv, plan_path).

    Each step parses ``argv`` as pretrain_gpt.py does, loads the plan with ``load_any_plan`` and
    runs pretrain_gpt.py's ``run`` with it; its PretrainResult and rank 0's printed lines are returned per step. Then
    ``pipeline_check`` = (argv, pipeline_plan_path, checkpoint_dir): a HeteroTrainer under that
    pipeline Plan loads the sharded checkpoint and evaluates validation iteration 0.
    """
    import contextlib
    import io

    from megatron_het.checkpoint.dist_ckpt import iteration_dir, latest_iteration
    from megatron_het.cli.pretrain import batch_fns, run
    from megatron_het.platform import detect_accelerator, enable_cpu_backend
    from megatron_het.runtime.arguments import parse_args
    from megatron_het.runtime.hetero_trainer import HeteroTrainer
    from megatron_het.sharding.plan import ShardedPlan, load_any_plan

    enable_cpu_backend()
    out = {"steps": []}
    for argv, plan_path in steps:
        args = parse_args(argv)
        plan = load_any_plan(plan_path)
        assert isinstance(plan, ShardedPlan)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            result = run(args, detect_accelerator(), plan=plan)
        out["steps"].append((result, buf.getvalue()))
    argv, plan_path, ckpt = pipeline_check
    args = parse_args(argv)
    train_fn, valid_fn = batch_fns(args)
    trainer = HeteroTrainer(model=args.model, plan=load_any_plan(plan_path), train=args.train,
                            batch_fn=train_fn, slowdown=1.0)
    loaded = trainer.load_checkpoint(iteration_dir(ckpt, latest_iteration(ckpt)))
    out["pipeline"] = (loaded, trainer.evaluate(valid_fn, 0))
    return out
