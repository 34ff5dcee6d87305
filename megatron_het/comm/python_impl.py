"""Pure-Python twin of csrc/het_backend.cpp: the same hierarchical phases over torch ProcessGroups.

Used where the C++ extension cannot be built. Collectives run on one worker thread per group so
``async_op=True`` returns at once and the caller's compute overlaps the communication.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_het.comm.diagnose import failure_message, ranks_behind, record_entry
from megatron_het.comm.membership import HetTopology, shard_sizes
from megatron_het.comm.work import HetCommError
from megatron_het.platform import HOST_DEVICE

ReduceOp = dist.ReduceOp


@dataclass(frozen=True, kw_only=True)
class BridgeGroups:
    """The process groups one rank uses; created collectively by `new_hierarchical_group`."""

    intra: dist.ProcessGroup  # this rank's island, native backend
    leaders: dist.ProcessGroup | None  # one rank per island, gloo; None on non-leaders
    peer: dist.ProcessGroup | None  # member j of every island (j < shards), gloo: exchanges all-reduce
    # shard j; the leaders group for j = 0; None on members j >= shards (they hold no shard)
    bridge: dist.ProcessGroup  # every rank of the group, gloo: cross-island send/recv
    store: dist.Store  # prefix store for the entry counters of this group


def stage(t: torch.Tensor) -> torch.Tensor:
    """Host copy for the gloo bridge (the tensor itself when it already is a contiguous host tensor)."""
    if t.device.type == HOST_DEVICE.type:
        return t.contiguous()
    return t.to(HOST_DEVICE, non_blocking=False)


def _base(op: ReduceOp) -> ReduceOp:
    return ReduceOp.SUM if op == ReduceOp.AVG else op


class PythonHetComm:
    """Hierarchical collectives of one rank in one group (see module docstring)."""

    def __init__(self, *, topology: HetTopology, rank: int, name: str, groups: BridgeGroups,
                 chunk_bytes: int, link_bytes_per_s: float, timeout_s: float) -> None:
        self.topology = topology
        self.rank = rank  # global rank
        self.name = name  # group name used in error messages
        self.groups = groups
        self.chunk_bytes = chunk_bytes
        self.link_bytes_per_s = link_bytes_per_s  # 0: no emulated slow link
        self.timeout_s = timeout_s
        self.group_rank = topology.group_rank(rank)
        self.island = topology.island_of(rank)
        self.members = topology.members[self.island]
        self.leader = self.members[0]
        self.is_leader = rank == self.leader
        self._seq = itertools.count(1)
        self._bridge_bytes = 0
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"het-{name}")

    def bridge_bytes(self) -> int:
        """Bytes this rank has sent across the island boundary (ring model, see docs): in an
        all-reduce only shard holders send, each 2(k-1)/k of its shard."""
        return self._bridge_bytes

    def close(self) -> None:
        """Stop the worker thread after the queued collectives."""
        self._worker.shutdown(wait=True)

    # -- plumbing ------------------------------------------------------------------------------
    def submit(self, op: str, job: Callable[[], None]) -> Future:
        """Run `job` on the worker; failures become HetCommError naming the missing ranks."""
        seq = next(self._seq)
        record_entry(self.groups.store, self.group_rank, seq)
        start = time.monotonic()

        def run() -> None:
            try:
                job()
            except Exception as exc:
                behind = ranks_behind(self.groups.store, len(self.topology.ranks), seq)
                cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise HetCommError(failure_message(
                    group=self.name, rank=self.rank, op=op, seq=seq, waited_s=time.monotonic() - start,
                    timeout_s=self.timeout_s, behind=behind, global_ranks=self.topology.ranks,
                    cause=cause)) from exc

        return self._worker.submit(run)

    def _throttle(self, nbytes: int) -> None:
        self._bridge_bytes += nbytes
        if self.link_bytes_per_s > 0:
            time.sleep(nbytes / self.link_bytes_per_s)

    @property
    def _k(self) -> int:
        return len(self.topology.islands)

    @property
    def _m(self) -> int:
        return len(self.members)

    # -- collectives -----------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: ReduceOp) -> Future:
        def job() -> None:
            flat = t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)
            self._all_reduce_flat(flat, _base(op))
            if op == ReduceOp.AVG:
                flat.div_(len(self.topology.ranks))
            if not t.is_contiguous():
                t.copy_(flat.view(t.shape))
        return self.submit("all_reduce", job)

    def _all_reduce_flat(self, flat: torch.Tensor, op: ReduceOp) -> None:
        # Sharded across islands: the tensor is cut into S = topology.shards pieces; inside each
        # island shard j is reduced to member j, member j of every island all-reduces it over its own
        # link (peer group j), and each shard is broadcast back inside the island from its holder.
        # So every island's link carries 2(k-1)/k of the tensor spread over S ranks at once, not
        # through one leader. S = 1 is the leader algorithm. Every shard is cut into chunks, and chunk
        # c's exchange runs while the holder spends chunk c+1's link time, so no phase waits for the
        # whole tensor. Per-shard reduces and broadcasts, not reduce-scatter / all-gather: gloo's
        # reduce-scatter and all-gather copy their inputs on the calling thread (the one that spends
        # the link time) and cost more than the reduces (measured: docs/communicator.md). Intra-island
        # ops are issued in the same order on every member (gloo matches collectives by issue
        # order): all reduces first, then chunk by chunk the broadcasts.
        g, m, k, shards = self.groups, self._m, self._k, self.topology.shards
        j = self.members.index(self.rank)  # this rank holds shard j when j < shards
        per = max(1, self.chunk_bytes // flat.element_size())
        pieces = [p.split(per) if p.numel() else () for p in flat.split(shard_sizes(flat.numel(), shards))]
        n = max(len(p) for p in pieces)
        # row c: chunk c of every shard that has one (a later shard is never longer: always a prefix)
        rows = [[p[c] for p in pieces if c < len(p)] for c in range(n)]
        reducing: dict[int, list] = {}  # chunk -> its island reduce works, until waited here
        if m > 1:
            for c, row in enumerate(rows):
                reducing[c] = [dist.reduce(p, dst=self.members[s], op=op, group=g.intra, async_op=True)
                               for s, p in enumerate(row)]
        exchanging: dict[int, tuple[torch.Tensor, torch.Tensor, object]] = {}  # chunk -> (piece, staged, work)
        sends: list = []

        def reduced(c: int) -> None:  # gloo may run ops concurrently: never send over a live reduce
            for w in reducing.pop(c, ()):
                w.wait()

        def exchange(c: int) -> None:  # shard j's chunk c to the other islands' holders of shard j
            reduced(c)
            piece = rows[c][j]
            staged = stage(piece)
            self._throttle(2 * (k - 1) * piece.numel() * piece.element_size() // k)  # ring model
            exchanging[c] = (piece, staged, dist.all_reduce(staged, op=op, group=g.peer, async_op=True))

        def send_back(c: int) -> None:  # chunk c of every shard from its holder to the island
            reduced(c)
            if c in exchanging:
                piece, staged, work = exchanging.pop(c)
                work.wait()
                if staged.data_ptr() != piece.data_ptr():
                    piece.copy_(staged)
            if m > 1:
                sends.extend(dist.broadcast(p, src=self.members[s], group=g.intra, async_op=True)
                             for s, p in enumerate(rows[c]))

        mine = len(pieces[j]) if j < shards and k > 1 else 0
        for c in range(n):
            if c < mine:
                exchange(c)
            if c > 0:
                send_back(c - 1)
        if n:
            send_back(n - 1)
        for w in sends:
            w.wait()

    def broadcast(self, t: torch.Tensor, src: int) -> Future:
        def job() -> None:
            g = self.groups
            buf = t.contiguous()
            root_island = self.topology.island_of(src)
            if self._m > 1 and root_island == self.island:
                dist.broadcast(buf, src=src, group=g.intra)
            if self.is_leader and self._k > 1:
                host = stage(buf)
                if root_island == self.island:
                    self._throttle(host.numel() * host.element_size())
                dist.broadcast(host, src=self.topology.leaders[root_island], group=g.leaders)
                if host.data_ptr() != buf.data_ptr():
                    buf.copy_(host)
            if self._m > 1 and root_island != self.island:
                dist.broadcast(buf, src=self.leader, group=g.intra)
            if buf.data_ptr() != t.data_ptr():
                t.copy_(buf)
        return self.submit("broadcast", job)

    def all_gather(self, outs: list[torch.Tensor], t: torch.Tensor) -> Future:
        def job() -> None:
            g, topo = self.groups, self.topology
            sizes = {r: outs[i].numel() for i, r in enumerate(topo.ranks)}
            blocks = [sum(sizes[r] for r in m) for m in topo.members]
            offsets = [sum(blocks[:i]) for i in range(len(blocks))]
            full = torch.empty(sum(blocks), dtype=t.dtype, device=t.device)
            mine = full.narrow(0, offsets[self.island], blocks[self.island])
            pad = max(sizes[r] for r in self.members)
            if self._m > 1:  # phase 1: island block at the leader, pieces padded to equal size
                piece = torch.zeros(pad, dtype=t.dtype, device=t.device)
                piece[: sizes[self.rank]].copy_(t.reshape(-1))
                got = [torch.empty_like(piece) for _ in self.members] if self.is_leader else None
                dist.gather(piece, gather_list=got, dst=self.leader, group=g.intra)
                if self.is_leader:
                    torch.cat([p[: sizes[r]] for p, r in zip(got, self.members)], out=mine)
            else:
                mine.copy_(t.reshape(-1))
            if self.is_leader and self._k > 1:  # phase 2: blocks padded to the largest
                width = max(blocks)
                send = torch.zeros(width, dtype=t.dtype, device=HOST_DEVICE)
                send[: blocks[self.island]].copy_(mine)
                got = [torch.empty_like(send) for _ in topo.islands]
                self._throttle((self._k - 1) * width * send.element_size())
                dist.all_gather(got, send, group=g.leaders)
                for i, block in enumerate(got):
                    if i != self.island:
                        full.narrow(0, offsets[i], blocks[i]).copy_(block[: blocks[i]])
            if self._m > 1:  # phase 3: the whole concatenation to every island member
                dist.broadcast(full, src=self.leader, group=g.intra)
            for i, m in enumerate(topo.members):
                off = offsets[i]
                for r in m:
                    out = outs[topo.ranks.index(r)]
                    out.copy_(full[off: off + sizes[r]].view(out.shape))
                    off += sizes[r]
        return self.submit("all_gather", job)

    def reduce_scatter(self, out: torch.Tensor, ins: list[torch.Tensor], op: ReduceOp) -> Future:
        def job() -> None:
            g, topo = self.groups, self.topology
            base = _base(op)
            numel = {r: ins[i].numel() for i, r in enumerate(topo.ranks)}
            width = max(sum(numel[r] for r in m) for m in topo.members)
            buf = torch.zeros(self._k * width, dtype=out.dtype, device=out.device)
            for i, m in enumerate(topo.members):  # island-ordered, block-padded layout
                off = i * width
                for r in m:
                    buf[off: off + numel[r]].copy_(ins[topo.ranks.index(r)].reshape(-1))
                    off += numel[r]
            if self._m > 1:
                dist.reduce(buf, dst=self.leader, op=base, group=g.intra)
            mine = buf.narrow(0, self.island * width, width)
            if self.is_leader and self._k > 1:
                host = stage(buf)
                got = torch.empty(width, dtype=host.dtype, device=HOST_DEVICE)
                self._throttle((self._k - 1) * width * host.element_size())
                dist.reduce_scatter(got, list(host.split(width)), op=base, group=g.leaders)
                mine.copy_(got)
            pad = max(numel[r] for r in self.members)
            if self._m > 1:
                pieces = None
                if self.is_leader:
                    pieces, off = [], 0
                    for r in self.members:
                        p = torch.zeros(pad, dtype=out.dtype, device=out.device)
                        p[: numel[r]].copy_(mine[off: off + numel[r]])
                        off += numel[r]
                        pieces.append(p)
                got = torch.empty(pad, dtype=out.dtype, device=out.device)
                dist.scatter(got, scatter_list=pieces, src=self.leader, group=g.intra)
                out.copy_(got[: out.numel()].view(out.shape))
            else:
                out.copy_(mine[: out.numel()].view(out.shape))
            if op == ReduceOp.AVG:
                out.div_(len(topo.ranks))
        return self.submit("reduce_scatter", job)

    def barrier(self) -> Future:
        return self.submit("barrier", lambda: self._all_reduce_flat(torch.zeros(1, device=HOST_DEVICE), ReduceOp.SUM))

    # -- point to point: issued on the caller thread so a send and its recv can both be posted --
    def isend(self, t: torch.Tensor, dst: int, tag: int):
        g = self.groups
        if self.topology.island_of(dst) == self.island:
            return dist.isend(t, dst=dst, group=g.intra, tag=tag)
        host = stage(t)
        self._throttle(host.numel() * host.element_size())
        return dist.isend(host, dst=dst, group=g.bridge, tag=tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int):
        g = self.groups
        if self.topology.island_of(src) == self.island:
            return dist.irecv(t, src=src, group=g.intra, tag=tag)
        if t.device.type == HOST_DEVICE.type and t.is_contiguous():
            return dist.irecv(t, src=src, group=g.bridge, tag=tag)
        host = torch.empty(t.shape, dtype=t.dtype, device=HOST_DEVICE)
        inner = dist.irecv(host, src=src, group=g.bridge, tag=tag)
        return _CopyBack(inner, host, t)


class _CopyBack:
    """A recv into a host buffer whose wait() also copies the data to the device tensor."""

    def __init__(self, inner, host: torch.Tensor, target: torch.Tensor) -> None:
        self._inner, self._host, self._target = inner, host, target

    def wait(self) -> bool:
        self._inner.wait()
        self._target.copy_(self._host)
        return True

    def is_completed(self) -> bool:
        return self._inner.is_completed()
