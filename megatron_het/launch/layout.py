"""Plan (either kind) + cluster + placements -> heterogeneous-job components (pure).

Global ranks are assigned island by island in cluster-file order (the training entry point's
convention), so the ranks a plan puts on one island must be one consecutive block, and the blocks
must follow the cluster file's island order. Each island used by the plan becomes one component of
a Slurm heterogeneous job; its node count and processes per node come from the plan's ranks on it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_het.cluster import HOST, ClusterSpec
from megatron_het.launch.environment import island_environment
from megatron_het.launch.errors import LaunchError
from megatron_het.plan import AnyPlan

# Slurm partition names and node-list expressions: no spaces, quotes or shell metacharacters.
_SLURM_WORD = re.compile(r"^[A-Za-z0-9_.,\-\[\]]+$")


@dataclass(frozen=True, kw_only=True)
class IslandPlacement:
    """Where Slurm finds the nodes of one island."""

    island: str  # island name in the cluster file
    partition: str | None = None  # Slurm partition (-p), None: the cluster's default partition
    nodelist: str | None = None  # Slurm node list (-w), e.g. "gpu[00-03]"; None: any nodes of the partition

    def __post_init__(self) -> None:
        for name in ("partition", "nodelist"):
            value = getattr(self, name)
            if value is not None and not _SLURM_WORD.match(value):
                raise LaunchError(field=f"--{name} {self.island}", value=value,
                                  problem="not a Slurm name (letters, digits, _ . - , [ ] only)",
                                  fix=f"write e.g. --{name} {self.island}=" + ("gpu" if name == "partition"
                                                                                 else "n[0-3]"))


@dataclass(frozen=True, kw_only=True)
class HetComponent:
    """One component of the heterogeneous job: the nodes of one island that the plan uses."""

    index: int  # het group number (0 holds the rendezvous endpoint)
    island: str  # island name
    device_type: str  # catalog name of the island's device
    vendor: str  # "nvidia" | "amd" | "cpu": picks the environment and whether GPUs are requested
    partition: str | None  # Slurm partition, None for the default one
    nodelist: str | None  # Slurm node list, None for any
    nodes: int  # nodes of this component
    procs_per_node: int  # torchrun --nproc-per-node on each of them
    first_node_rank: int  # torchrun --node-rank of the component's first node
    first_rank: int  # global rank of its first process
    environment: tuple[tuple[str, str], ...]  # exported to every rank of the component (vendor, interface)

    @property
    def num_ranks(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def gpus_per_node(self) -> int:
        """GPUs to request per node (0 on CPU islands)."""
        return 0 if self.vendor == HOST else self.procs_per_node


def parse_assignments(values: Sequence[str], *, option: str) -> dict[str, str]:
    """``["fast=p0", "slow=p1"]`` -> ``{"fast": "p0", "slow": "p1"}`` (CLI ISLAND=VALUE options)."""
    out: dict[str, str] = {}
    for value in values:
        island, sep, target = value.partition("=")
        if not sep or not island or not target:
            raise LaunchError(field=option, value=value, problem="expected ISLAND=VALUE",
                              fix=f"write {option} ISLAND=VALUE, e.g. {option} fast=p0")
        if island in out:
            raise LaunchError(field=option, value=value, problem=f"island {island!r} is given twice",
                              fix=f"give {option} once per island")
        out[island] = target
    return out


def placements_from_options(cluster: ClusterSpec, partitions: Mapping[str, str],
                            nodelists: Mapping[str, str]) -> dict[str, IslandPlacement]:
    """Island name -> placement; names must be islands of the cluster."""
    for option, mapping in (("--partition", partitions), ("--nodelist", nodelists)):
        for island in mapping:
            if island not in cluster.island_names:
                raise LaunchError(field=option, value=island, problem="not an island of the cluster",
                                  fix=f"use one of: {', '.join(cluster.island_names)}")
    return {name: IslandPlacement(island=name, partition=partitions.get(name), nodelist=nodelists.get(name))
            for name in cluster.island_names}


def _ranks_by_island(plan: AnyPlan, cluster: ClusterSpec) -> dict[str, tuple[int, ...]]:
    by_island = plan.island_ranks()
    for island in by_island:
        if island not in cluster.island_names:
            raise LaunchError(field="plan", value=island, problem="places ranks on an island the cluster does not have",
                              fix=f"use the cluster file the plan was made for (islands: "
                                  f"{', '.join(cluster.island_names)})")
    return by_island


def het_components(cluster: ClusterSpec, plan: AnyPlan,
                   placements: Mapping[str, IslandPlacement]) -> tuple[HetComponent, ...]:
    """One component per island the plan uses, in cluster-file order, with node and rank offsets.

    Either plan kind: a pipeline plan's ranks per island come from its stages, a sharded plan's from
    its rank shares."""
    by_island = _ranks_by_island(plan, cluster)
    components: list[HetComponent] = []
    next_rank = next_node = 0
    for island in cluster.islands:
        ranks = list(by_island.get(island.name, ()))
        if not ranks:
            continue  # unused islands get no component
        expected = list(range(next_rank, next_rank + len(ranks)))
        if ranks != expected:
            raise LaunchError(
                field=f"plan ranks on island {island.name}", value=ranks,
                problem=f"global ranks are given island by island in cluster-file order, so this island "
                        f"must hold ranks {expected[0]}..{expected[-1]}",
                fix="renumber the plan's ranks (tools/plan.py does) or reorder the islands in the cluster file")
        n = len(ranks)
        if n > island.num_gpus:
            raise LaunchError(
                field=f"plan ranks on island {island.name}", value=n,
                problem=f"{n} ranks exceed the island's {island.num_gpus} GPUs "
                        f"({island.nodes} nodes x {island.gpus_per_node})",
                fix=f"use at most {island.num_gpus} ranks on {island.name} or grow the island in the cluster file")
        per_node = min(n, island.gpus_per_node)
        if n % per_node:
            raise LaunchError(
                field=f"plan ranks on island {island.name}", value=n,
                problem=f"{n} ranks do not fill whole nodes of {island.gpus_per_node} GPUs "
                        "(one torchrun per node starts the same number of processes)",
                fix=f"use a multiple of {island.gpus_per_node} ranks on {island.name}")
        placement = placements.get(island.name, IslandPlacement(island=island.name))
        nodes = n // per_node
        listed = nodelist_size_hint(placement.nodelist) if placement.nodelist else None
        if listed is not None and listed != nodes:
            raise LaunchError(
                field=f"--nodelist {island.name}", value=placement.nodelist,
                problem=f"lists {listed} nodes but the plan's {n} ranks on {island.name} need {nodes} "
                        f"({per_node} per node); Slurm would allocate every listed node",
                fix=f"list exactly {nodes} node(s) for {island.name}")
        components.append(HetComponent(
            index=len(components), island=island.name, device_type=island.device.name,
            vendor=island.device.vendor, partition=placement.partition, nodelist=placement.nodelist,
            nodes=nodes, procs_per_node=per_node, first_node_rank=next_node, first_rank=next_rank,
            environment=island_environment(island.device.vendor, network_interface=island.network_interface),
        ))
        next_rank += n
        next_node += nodes
    return tuple(components)


def total_nodes(components: Sequence[HetComponent]) -> int:
    return sum(c.nodes for c in components)


def nodelist_size_hint(nodelist: str) -> int | None:
    """Number of hosts in a simple Slurm node list ("n[0-3],m5" -> 5); None when not simple."""
    count = 0
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", nodelist):
        m = re.search(r"\[([^\]]*)\]", part)
        if not m:
            count += 1
            continue
        for piece in m.group(1).split(","):
            lo, _, hi = piece.partition("-")
            if not (lo.isdigit() and (not hi or hi.isdigit())):
                return None
            count += (int(hi) - int(lo) + 1) if hi else 1
    return count if count else None
