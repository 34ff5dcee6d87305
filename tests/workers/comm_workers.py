"""Rank functions for the communicator tests (module-level so spawned ranks can import them; no tests)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_het.comm import HetCommError, IslandMembership, new_hierarchical_group

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
       "min": dist.ReduceOp.MIN}


SHARDED_ISLANDS = ([3, 2], [2, 2, 1], [4, 2], [3, 3])  # shards: 2, 1 (the leader algorithm), 2, 3
SHARDED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
SHARDED_SIZES = (1, 2, 37, 700, 1025)  # below the shard count, odd, several 1 KiB chunks per shard
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53, torch.bfloat16: 2.0 ** -8}
BYTES_PROBE = 700  # fp32 elements of the all-reduce whose bridge bytes the test checks


def membership_of(island_sizes: list[int]) -> IslandMembership:
    """Islands as consecutive rank blocks; alternate backends so the group needs a bridge."""
    rank_to_island, backends, r = {}, {}, 0
    for i, n in enumerate(island_sizes):
        name = f"island{i}"
        backends[name] = "nccl" if i % 2 else "gloo"
        for _ in range(n):
            rank_to_island[r] = name
            r += 1
    return IslandMembership(rank_to_island=rank_to_island, island_backend=backends)


def _data(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(numel, generator=g).to(dtype)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    tol = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 5e-3}[a.dtype]
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def all_cases(rank: int, world: int, implementations: list[str]) -> dict:
    """One 6-rank spawn for the whole suite (a spawn costs ~20 s of torch imports on 2 cores).

    "three": islands of 1-2-3 ranks over the world; "two": islands of 2-2 on ranks 0-3 (4 and 5
    are non-members, which only join group creation); "skip": rank 3 skips an all-reduce.
    """
    out: dict = {"three": {}, "two": {}, "skip": {}, "wait": {}, "sharded": {}, "uneven": {}}
    for impl in implementations:
        out["sharded"][impl] = {str(sizes): _sharded_all_reduce(rank, sizes, impl) for sizes in SHARDED_ISLANDS}
        out["uneven"][impl] = {method: _uneven_over_bridge(rank, [4, 2], impl, method)
                               for method in ("leaders", "all_reduce")}
        out["three"][impl] = _compare_one(rank, world, [1, 2, 3], impl, [5, 37], 1024)
        # 1 and 37 elements: not divisible by the island size; 700 fp32 elements with 1 KiB
        # chunks: the all-reduce pipeline runs three chunks.
        out["two"][impl] = _compare_one(rank, world, [2, 2], impl, [1, 37, 700], 1024)
        out["skip"][impl] = _skip(rank, world, impl, 3, 2.0)
        out["wait"][impl] = _wait_timeout(rank, world, impl, 3, 2.0, 0.3)
    return out


def _compare_one(rank: int, world: int, island_sizes: list[int], implementation: str,
                 sizes: list[int], chunk_bytes: int) -> dict:
    n = sum(island_sizes)
    flat = dist.new_group(list(range(n)), backend="gloo") if n < dist.get_world_size() else None
    het = new_hierarchical_group(list(range(n)), membership_of(island_sizes),
                                 implementation=implementation, chunk_bytes=chunk_bytes, timeout_s=60)
    if het is None:
        return {"member": False}
    world = n
    bad: list[str] = []
    seed = 0
    # every size meets every dtype and both sync modes across the list, without the full product
    cases = [(DTYPES[i % len(DTYPES)], numel, bool(i % 2)) for i, numel in enumerate(sizes)]
    cases += [(DTYPES[(i + 1) % len(DTYPES)], numel, not bool(i % 2)) for i, numel in enumerate(sizes)]
    for dtype, numel, async_op in cases:
        seed += 1
        tag = f"{dtype} n={numel} async={async_op}"
        for name, op in OPS.items():
            x = _data(seed, rank, numel, dtype)
            ref = x.float()
            dist.all_reduce(ref, op=dist.ReduceOp.SUM if name == "avg" else op, group=flat)
            if name == "avg":
                ref /= world
            w = het.all_reduce(x, op=op, async_op=async_op)
            if async_op:
                w.wait()
            if not _close(x, ref.to(dtype)):
                bad.append(f"all_reduce {name} {tag}")
        # all_gather, uneven sizes: rank r contributes numel + r elements
        sizes_r = [numel + r for r in range(world)]
        x = _data(seed, rank, sizes_r[rank], dtype)
        outs = [torch.empty(s, dtype=dtype) for s in sizes_r]
        w = het.all_gather(outs, x, async_op=async_op)
        if async_op:
            w.wait()
        refs = [_data(seed, r, sizes_r[r], dtype) for r in range(world)]
        if not all(torch.equal(o, e) for o, e in zip(outs, refs)):
            bad.append(f"all_gather {tag}")
        # reduce_scatter, uneven sizes; sum and avg
        for name in ("sum", "avg"):
            ins = [_data(seed + 7 * r, rank, sizes_r[r], dtype) for r in range(world)]
            out = torch.empty(sizes_r[rank], dtype=dtype)
            w = het.reduce_scatter(out, ins, op=OPS[name], async_op=async_op)
            if async_op:
                w.wait()
            ref = sum(_data(seed + 7 * rank, q, sizes_r[rank], dtype).float() for q in range(world))
            if name == "avg":
                ref = ref / world
            if not _close(out, ref.to(dtype)):
                bad.append(f"reduce_scatter {name} {tag}")
        # broadcast from every rank
        for src in range(world):
            x = _data(seed, rank, numel, dtype)
            w = het.broadcast(x, src=src, async_op=async_op)
            if async_op:
                w.wait()
            if not torch.equal(x, _data(seed, src, numel, dtype)):
                bad.append(f"broadcast src={src} {tag}")
    # send/recv around a ring (crosses islands and stays inside them), then barrier
    x = torch.full((5,), float(rank))
    y = torch.empty(5)
    s = het.isend(x, dst=(rank + 1) % world)
    r = het.irecv(y, src=(rank - 1) % world)
    s.wait()
    r.wait()
    if not torch.equal(y, torch.full((5,), float((rank - 1) % world))):
        bad.append(f"send/recv got {y.tolist()}")
    het.barrier()
    # overlap: an async all_reduce completes while the caller computes
    big = torch.ones(1 << 18)
    w = het.all_reduce(big, async_op=True)
    torch.mm(torch.ones(64, 64), torch.ones(64, 64))
    w.wait()
    if not torch.equal(big, torch.full((1 << 18,), float(world))):
        bad.append("async all_reduce with overlap")
    bytes_sent = het.bridge_bytes()
    if het.process_group is not None:  # the C++ backend also serves plain torch.distributed calls
        z = torch.full((3,), float(rank + 1))
        dist.all_reduce(z, group=het.process_group)
        if not torch.equal(z, torch.full((3,), float(world * (world + 1) // 2))):
            bad.append(f"dist.all_reduce on process_group got {z.tolist()}")
    info = het.info
    het.close()
    return {"member": True, "bad": bad, "implementation": info.implementation, "reason": info.reason,
            "bridge_bytes": bytes_sent, "is_leader": rank in het.topology.leaders}


def _skip(rank: int, world: int, implementation: str, skipper: int, timeout_s: float) -> dict:
    het = new_hierarchical_group([0, 1, 2, 3], membership_of([2, 2]),
                                 implementation=implementation, timeout_s=timeout_s)
    result = {"error": None, "elapsed": 0.0}
    if het is not None:
        het.all_reduce(torch.ones(4))  # #1: everyone
    if het is None:
        pass
    elif rank == skipper:
        time.sleep(timeout_s * 2.5)  # stop answering long enough for everyone else to time out
    else:
        start = time.monotonic()
        try:
            het.all_reduce(torch.ones(4))  # #2: the skipper never comes
        except HetCommError as exc:
            result["error"] = str(exc)
        result["elapsed"] = time.monotonic() - start
    dist.barrier()  # world group: line everyone up again before the next group is created
    return result


def _wait_timeout(rank: int, world: int, implementation: str, skipper: int, timeout_s: float,
                  wait_s: float) -> dict:
    """Work.wait(timeout) returns control after ``wait_s`` while the collective (which ``skipper``
    never joins) is still pending; waiting again without a timeout ends at the group's timeout."""
    import datetime

    het = new_hierarchical_group([0, 1, 2, 3], membership_of([2, 2]),
                                 implementation=implementation, timeout_s=timeout_s)
    result = {"early": None, "early_s": 0.0, "final": None}
    if het is not None and rank == skipper:
        time.sleep(timeout_s * 2.5)
    elif het is not None:
        work = het.all_reduce(torch.ones(4), async_op=True)
        start = time.monotonic()
        try:
            work.wait(datetime.timedelta(seconds=wait_s))
        except HetCommError as exc:
            result["early"] = str(exc)
        result["early_s"] = time.monotonic() - start
        try:
            work.wait()
        except HetCommError as exc:
            result["final"] = str(exc)
    dist.barrier()
    return result


def _sharded_all_reduce(rank: int, island_sizes: list[int], implementation: str) -> dict:
    """All-reduce (sum, avg) over islands of unequal sizes against a float64 sum computed here from
    every rank's (reproducible) input. Tolerance: the bound of n - 1 rounded additions (plus the
    average's division), n * u * sum |x_r|, u the dtype's unit roundoff. Also the bridge bytes of
    one BYTES_PROBE-element fp32 all-reduce."""
    n = sum(island_sizes)
    het = new_hierarchical_group(list(range(n)), membership_of(island_sizes), implementation=implementation,
                                 chunk_bytes=1024, timeout_s=60)
    if het is None:
        return {"member": False}
    bad: list[str] = []
    seed = 100
    for dtype in SHARDED_DTYPES:
        for numel in SHARDED_SIZES:
            for name in ("sum", "avg"):
                seed += 1
                inputs = [_data(seed, r, numel, dtype) for r in range(n)]
                ref = sum(x.double() for x in inputs)
                bound = n * UNIT_ROUNDOFF[dtype] * sum(x.double().abs() for x in inputs) + 1e-300
                if name == "avg":
                    ref, bound = ref / n, bound / n
                x = inputs[rank].clone()
                het.all_reduce(x, op=OPS[name])
                err = (x.double() - ref).abs()
                if not bool((err <= bound).all()):
                    bad.append(f"{name} {dtype} n={numel}: max error {err.max().item():.3g}, "
                               f"bound {bound[err.argmax()].item():.3g}")
    before = het.bridge_bytes()
    het.all_reduce(torch.ones(BYTES_PROBE))
    sent = het.bridge_bytes() - before
    het.close()
    return {"member": True, "bad": bad, "bridge_bytes": sent}



def _uneven_over_bridge(rank: int, island_sizes: list[int], implementation: str, method: str) -> dict:
    """comm.uneven's reduce-scatter and all-gather through the bridge, leader-based (``leaders``:
    the default methods) or as the sharded all-reduce (``all_reduce``, the distributed optimizer's
    choice when every island has >= 2 ranks), uneven sizes (one rank owns nothing), against sums
    and concatenations computed here; bridge bytes of each."""
    from megatron_het.comm.uneven import uneven_all_gather, uneven_reduce_scatter
    from megatron_het.optim.layout import ShardLayout

    n = sum(island_sizes)
    het = new_hierarchical_group(list(range(n)), membership_of(island_sizes), implementation=implementation,
                                 chunk_bytes=1024, timeout_s=60)
    if het is None:
        return {"member": False}
    layout = ShardLayout(sizes=tuple(37 + 50 * r if r != 2 else 0 for r in range(n)))
    rs_kw, ag_kw = ({"method": "all_reduce"}, {"method": "all_reduce"}) if method == "all_reduce" else ({}, {})
    bad: list[str] = []
    fulls = [_data(300, r, layout.numel, torch.float32) for r in range(n)]
    before = het.bridge_bytes()
    mine = uneven_reduce_scatter(fulls[rank], layout, bridge=het, **rs_kw)
    rs_bytes = het.bridge_bytes() - before
    start, stop = layout.range(rank)
    ref = sum(f.double() for f in fulls)[start:stop]
    bound = n * 2.0 ** -24 * sum(f.double().abs() for f in fulls)[start:stop]
    if mine.shape != ref.shape or not bool(((mine.double() - ref).abs() <= bound).all()):
        bad.append(f"reduce_scatter {method}")
    shards = [_data(400, r, layout.sizes[r], torch.float32) for r in range(n)]
    before = het.bridge_bytes()
    full = uneven_all_gather(shards[rank], layout, bridge=het, **ag_kw)
    ag_bytes = het.bridge_bytes() - before
    if not torch.equal(full, torch.cat(shards)):
        bad.append(f"all_gather {method}")
    het.close()
    return {"member": True, "bad": bad, "rs_bytes": rs_bytes, "ag_bytes": ag_bytes}
