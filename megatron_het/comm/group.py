"""`new_hierarchical_group`: one group over several islands, native inside, bridged between.

Creating a group is collective over the whole world (like ``torch.distributed.new_group``):
every rank calls it with the same arguments in the same order, members or not.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_het.comm.extension import HetBackendInfo, load_extension
from megatron_het.comm.membership import CommConfigError, HetTopology, IslandMembership, plan_topology
from megatron_het.comm.python_impl import BridgeGroups, PythonHetComm
from megatron_het.comm.work import HetWork
from megatron_het.platform import HOST_BACKEND, HOST_DEVICE, backend_devices, island_group_backend

IMPLEMENTATIONS = ("auto", "cpp", "python")
BACKEND_NAME = "het"  # the torch.distributed backend name registered by the C++ extension
MIN_CHUNK_BYTES = 1024  # smaller chunks only add per-message latency


@dataclass(frozen=True, kw_only=True)
class HetBackendOptions:
    """What the `het` backend creator needs besides the store (passed as ``pg_options``)."""

    groups: BridgeGroups  # this rank's intra, leaders, peer and bridge process groups
    topology: HetTopology  # islands of the group, same on every rank
    chunk_bytes: int  # all-reduce pipeline chunk
    link_bytes_per_s: float  # emulated inter-island rate (0: none)
    timeout_s: float  # reported in error messages


def _create_het_backend(dist_opts, options: HetBackendOptions):
    """`Backend.register_backend` creator (extended API): builds the C++ HetBackend."""
    module, reason = load_extension()
    if module is None:
        raise RuntimeError(f"the 'het' backend needs the C++ extension: {reason}")
    topo = options.topology
    return module.HetBackend(
        dist_opts.store, dist_opts.group_rank, dist_opts.group_size, str(dist_opts.group_id),
        options.groups.intra, options.groups.leaders, options.groups.peer, options.groups.bridge,
        topo.island_of_group_rank(), topo.intra_rank_of_group_rank(), topo.leader_group_ranks(),
        topo.shards, options.chunk_bytes, options.link_bytes_per_s, options.timeout_s)


def register_het_backend() -> None:
    """Register the `het` backend with torch.distributed (no-op when already registered)."""
    if hasattr(dist.Backend, BACKEND_NAME.upper()):
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_het_backend, extended_api=True, devices=backend_devices())


def intra_backend(native: str) -> str:
    """Backend string for an island's group: host tensors always on gloo, device tensors native."""
    return island_group_backend(native)


class HetGroup:
    """Hierarchical collectives of one rank of a group; torch.distributed-like signatures.

    Ranks (``src``/``dst``) are global ranks, as in torch.distributed. With ``async_op=True`` a
    `HetWork` is returned; otherwise the call returns None after completion.
    """

    def __init__(self, *, topology: HetTopology, info: HetBackendInfo, comm: PythonHetComm | None,
                 process_group: dist.ProcessGroup | None, name: str) -> None:
        self.topology = topology  # islands of the group
        self.info = info  # implementation in use and why
        self.name = name  # group name used in error messages
        self.process_group = process_group  # the `het` ProcessGroup (C++ only), usable with dist.*
        self._comm = comm  # Python twin (None when the C++ backend carries the traffic)

    @property
    def implementation(self) -> str:
        return self.info.implementation

    def bridge_bytes(self) -> int:
        """Bytes this rank has sent over the inter-island bridge so far (ring model, see docs)."""
        if self._comm is not None:
            return self._comm.bridge_bytes()
        return int(self.process_group._get_backend(HOST_DEVICE).bridge_bytes())

    @staticmethod
    def _finish(work, async_op: bool) -> HetWork | None:
        handle = HetWork(work)
        if async_op:
            return handle
        handle.wait()
        return None

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        if self._comm is not None:
            return self._finish(self._comm.all_reduce(tensor, op), async_op)
        return self._finish(dist.all_reduce(tensor, op=op, group=self.process_group, async_op=True), async_op)

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, async_op: bool = False):
        if len(tensor_list) != len(self.topology.ranks):
            raise CommConfigError(f"tensor_list has {len(tensor_list)} tensors but the group has "
                                  f"{len(self.topology.ranks)} ranks; pass one output per rank")
        if self._comm is not None:
            return self._finish(self._comm.all_gather(tensor_list, tensor), async_op)
        work = self.process_group.allgather([tensor_list], [tensor])
        return self._finish(work, async_op)

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor],
                       op=dist.ReduceOp.SUM, async_op: bool = False):
        if len(input_list) != len(self.topology.ranks):
            raise CommConfigError(f"input_list has {len(input_list)} tensors but the group has "
                                  f"{len(self.topology.ranks)} ranks; pass one input per rank")
        if self._comm is not None:
            return self._finish(self._comm.reduce_scatter(output, input_list, op), async_op)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = op
        return self._finish(self.process_group.reduce_scatter([output], [input_list], opts), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False):
        if self._comm is not None:
            return self._finish(self._comm.broadcast(tensor, src), async_op)
        return self._finish(dist.broadcast(tensor, src=src, group=self.process_group, async_op=True),
                            async_op)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> HetWork:
        if self._comm is not None:
            return HetWork(self._comm.isend(tensor, dst, tag))
        return HetWork(dist.isend(tensor, dst=dst, group=self.process_group, tag=tag))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> HetWork:
        if self._comm is not None:
            return HetWork(self._comm.irecv(tensor, src, tag))
        return HetWork(dist.irecv(tensor, src=src, group=self.process_group, tag=tag))

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.irecv(tensor, src, tag).wait()

    def barrier(self, async_op: bool = False):
        if self._comm is not None:
            return self._finish(self._comm.barrier(), async_op)
        return self._finish(self.process_group.barrier(), async_op)

    def close(self) -> None:
        """Stop the Python twin's worker thread (the C++ backend stops with its process group)."""
        if self._comm is not None:
            self._comm.close()


def _choose(implementation: str) -> HetBackendInfo:
    if implementation == "python":
        return HetBackendInfo(implementation="python", reason="implementation='python' requested",
                              gpu_build="none")
    module, reason = load_extension()
    if module is None:
        if implementation == "cpp":
            raise CommConfigError(f"implementation='cpp' but the C++ extension is unavailable: {reason}; "
                                  "install a C++ compiler or use implementation='auto'")
        return HetBackendInfo(implementation="python", reason=reason, gpu_build="none")
    return HetBackendInfo(implementation="cpp", reason=reason, gpu_build=str(module.GPU_BUILD))


def _check_settings(timeout_s: float, chunk_bytes: int, implementation: str, link_bytes_per_s: float) -> None:
    if not timeout_s > 0:
        raise CommConfigError(f"timeout_s = {timeout_s} must be > 0; pass seconds, e.g. 60")
    if chunk_bytes < MIN_CHUNK_BYTES:
        raise CommConfigError(f"chunk_bytes = {chunk_bytes} is below the minimum {MIN_CHUNK_BYTES}; "
                              f"use e.g. 4 << 20")
    if implementation not in IMPLEMENTATIONS:
        raise CommConfigError(f"implementation = {implementation!r} is not one of {list(IMPLEMENTATIONS)}")
    if link_bytes_per_s < 0:
        raise CommConfigError(f"link_bytes_per_s = {link_bytes_per_s} must be >= 0 (0 disables the "
                              "emulated slow link)")


def new_hierarchical_group(ranks: Sequence[int], membership: IslandMembership, *, timeout_s: float = 60,
                           chunk_bytes: int = 4 << 20, implementation: str = "auto",
                           link_bytes_per_s: float = 0.0, host_backend: str = HOST_BACKEND) -> HetGroup | None:
    """Create a hierarchical group over `ranks`; collective over the whole world.

    Returns None on ranks outside `ranks` (like ``new_group``'s non-member sentinel).
    ``link_bytes_per_s`` > 0 emulates a slow inter-island link on CPU: a rank sending across sleeps
    bytes / rate, each on its own (one link per rank; an all-reduce's shard holders sleep at once).
    ``implementation``: "cpp" (the `het` torch backend), "python" (the twin) or "auto" (C++ if
    it can be loaded or compiled, else Python; see `het_backend_info`). Every rank must resolve
    "auto" the same way, which holds when they share a machine image. ``host_backend``: the
    accelerator's backend for the host-staged leader, peer and bridge groups.
    """
    _check_settings(timeout_s, chunk_bytes, implementation, link_bytes_per_s)
    topo = plan_topology(ranks, membership)
    info = _choose(implementation)
    timeout = datetime.timedelta(seconds=timeout_s)
    intra = [dist.new_group(list(m), backend=intra_backend(b), timeout=timeout)
             for m, b in zip(topo.members, topo.backends)]
    leaders = dist.new_group(list(topo.leaders), backend=host_backend, timeout=timeout)
    # peer group j: member j of every island, exchanging shard j of an all-reduce over its own link;
    # member 0 of every island is the leaders group already
    peers = [leaders] + [dist.new_group([m[j] for m in topo.members], backend=host_backend, timeout=timeout)
                         for j in range(1, topo.shards)]
    bridge = dist.new_group(list(topo.ranks), backend=host_backend, timeout=timeout)
    me = dist.get_rank()
    member = me in topo.ranks
    groups = None
    if member:
        island = topo.island_of(me)
        j = topo.members[island].index(me)
        store = dist.PrefixStore(f"het/{bridge.group_name}/", dist.distributed_c10d._get_default_store())
        groups = BridgeGroups(intra=intra[island], leaders=leaders if me == topo.leaders[island] else None,
                              peer=peers[j] if j < topo.shards else None, bridge=bridge, store=store)
    if info.implementation == "cpp":
        register_het_backend()
        options = (HetBackendOptions(groups=groups, topology=topo, chunk_bytes=chunk_bytes,
                                     link_bytes_per_s=link_bytes_per_s, timeout_s=timeout_s)
                   if member else None)
        pg = dist.new_group(list(topo.ranks), backend=BACKEND_NAME, timeout=timeout, pg_options=options)
        if not member:
            return None
        return HetGroup(topology=topo, info=info, comm=None, process_group=pg, name=pg.group_name)
    if not member:
        return None
    name = bridge.group_name
    comm = PythonHetComm(topology=topo, rank=me, name=name, groups=groups, chunk_bytes=chunk_bytes,
                         link_bytes_per_s=link_bytes_per_s, timeout_s=timeout_s)
    return HetGroup(topology=topo, info=info, comm=comm, process_group=None, name=name)
