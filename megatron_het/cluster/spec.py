"""The cluster: islands of one device type each, the links between them, emulation settings.

The dataclasses validate themselves, so a spec built in code is as trustworthy as one loaded
from YAML. Field paths in their errors are relative ("nodes"); the loader prefixes the
position in the file ("islands[1].nodes").
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Mapping
from dataclasses import dataclass, field

from megatron_het.cluster.catalog import DeviceType
from megatron_het.cluster.errors import ConfigError, suggest
from megatron_het.cluster.fields import as_float, as_int, as_name, as_str, join

__all__ = [
    "IslandSpec",
    "LinkSpec",
    "IslandEmulation",
    "ClusterSpec",
    "DEFAULT_INTER_NODE_BANDWIDTH_GBPS",
    "DEFAULT_LINK_LATENCY_US",
    "DEFAULT_INTRA_NODE_LATENCY_US",
    "MAX_NODES_PER_ISLAND",
    "MAX_GPUS_PER_NODE",
    "MAX_CLUSTER_GPUS",
]

# A 100 Gbit/s NIC per GPU: a common InfiniBand HDR100 / 100GbE provisioning, and a safe
# (pessimistic) guess for a pod whose fabric the user did not state.
DEFAULT_INTER_NODE_BANDWIDTH_GBPS = 100.0
DEFAULT_LINK_LATENCY_US = 5.0  # one switch hop on InfiniBand/RoCE, order of magnitude
DEFAULT_INTRA_NODE_LATENCY_US = 2.0  # per message over NVLink/xGMI/PCIe inside a node, order of magnitude
# Sane bounds: the largest machines today have ~10^5 GPUs and 8-16 per node. A count beyond these is a
# typo, and the planner would build per-rank lists for it for minutes or forever.
MAX_NODES_PER_ISLAND = 65_536
MAX_GPUS_PER_NODE = 256
MAX_CLUSTER_GPUS = 1_048_576


@dataclass(frozen=True, kw_only=True)
class IslandSpec:
    """GPUs of one device type with one kind of link among them (a pod, a partition)."""

    name: str  # unique within the cluster, e.g. "a100-pod"
    device: DeviceType  # what every GPU of the island is
    nodes: int  # number of machines, >= 1
    gpus_per_node: int  # GPUs (ranks) per machine, >= 1
    inter_node_bandwidth_gbps: float = DEFAULT_INTER_NODE_BANDWIDTH_GBPS  # per GPU between nodes, Gbit/s
    # Per GPU inside a node, Gbit/s one direction; None means "take device.intra_node_bandwidth_gbps",
    # resolved in __post_init__ so readers always see a float.
    intra_node_bandwidth_gbps: float | None = None
    intra_node_latency_us: float = DEFAULT_INTRA_NODE_LATENCY_US  # per message / ring step inside a node
    inter_node_latency_us: float = DEFAULT_LINK_LATENCY_US  # per message / ring step between its nodes
    # Network interface the island's nodes talk through (e.g. "ib0", "eth1"); None: the libraries pick.
    # The generated sbatch script exports it as GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME.
    network_interface: str | None = None

    def __post_init__(self) -> None:
        as_name(self.name, "name")
        if not isinstance(self.device, DeviceType):
            raise ConfigError("must be a DeviceType", field="device", value=self.device,
                              fix="pass an entry of CATALOG or a DeviceType you built")
        as_int(self.nodes, "nodes", maximum=MAX_NODES_PER_ISLAND)
        as_int(self.gpus_per_node, "gpus_per_node", maximum=MAX_GPUS_PER_NODE)
        if self.network_interface is not None:
            as_name(self.network_interface, "network_interface", example="'ib0'", max_length=15,
                    fix="write one interface name as 'ip link' lists it, e.g. ib0 or eth1")
        inter = as_float(self.inter_node_bandwidth_gbps, "inter_node_bandwidth_gbps")
        object.__setattr__(self, "inter_node_bandwidth_gbps", inter)
        intra = self.intra_node_bandwidth_gbps
        intra = self.device.intra_node_bandwidth_gbps if intra is None else as_float(intra, "intra_node_bandwidth_gbps")
        object.__setattr__(self, "intra_node_bandwidth_gbps", intra)
        for name in ("intra_node_latency_us", "inter_node_latency_us"):
            object.__setattr__(self, name, as_float(getattr(self, name), name, minimum=0.0, inclusive=True))

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def peak_tflops(self) -> float:
        """Aggregate dense peak of the island, TFLOP/s."""
        return self.num_gpus * self.device.peak_tflops

    @property
    def memory_gib(self) -> float:
        """Aggregate device memory of the island, GiB."""
        return self.num_gpus * self.device.memory_gib


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """The network between two islands."""

    between: tuple[str, str]  # the two island names (order carries no meaning)
    bandwidth_gbps: float  # per GPU, Gbit/s one direction
    latency_us: float = DEFAULT_LINK_LATENCY_US  # one-way, microseconds, >= 0

    def __post_init__(self) -> None:
        between = self.between
        if not isinstance(between, (tuple, list)) or len(between) != 2:
            raise ConfigError("must name exactly two islands", field="between", value=between,
                              fix="write between: [island-a, island-b]")
        a, b = (as_str(n, join("between", i)) for i, n in enumerate(between))
        if a == b:
            raise ConfigError("a link must join two different islands", field="between", value=list(between),
                              fix="name two different islands; bandwidth inside an island is set on the island")
        object.__setattr__(self, "between", (a, b))
        object.__setattr__(self, "bandwidth_gbps", as_float(self.bandwidth_gbps, "bandwidth_gbps"))
        object.__setattr__(self, "latency_us", as_float(self.latency_us, "latency_us", inclusive=True))

    def joins(self, a: str, b: str) -> bool:
        return {a, b} == set(self.between)


EMULATION_CLOCKS = ("wall", "thread")  # IslandEmulation.clock


@dataclass(frozen=True, kw_only=True)
class IslandEmulation:
    """How a CPU process pretends to be a GPU of the island."""

    slowdown: float = 1.0  # >= 1.0: compute time multiplier relative to one core of the host
    # what the slowdown multiplies: "wall" (an action's wall time) or "thread" (the rank's thread CPU time
    # in it; time lost to other processes on shared cores is repaid from later waits, so the device keeps
    # its speed when more ranks than cores share the host, as long as their CPU demand fits the cores)
    clock: str = "wall"

    def __post_init__(self) -> None:
        object.__setattr__(self, "slowdown", as_float(self.slowdown, "slowdown", minimum=1.0, inclusive=True))
        if self.clock not in EMULATION_CLOCKS:
            raise ConfigError(f"unknown emulation clock {self.clock!r}", field="clock", value=self.clock,
                              fix=f"use one of {', '.join(EMULATION_CLOCKS)} (thread: the rank's thread CPU time x slowdown)")


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Islands plus the links between them; every pair of islands has exactly one link."""

    islands: tuple[IslandSpec, ...]  # at least one, unique names, in file order
    links: tuple[LinkSpec, ...] = ()  # one per pair of islands (none for a single island)
    # island name -> settings; empty when not emulated. When given, islands left out get slowdown 1.0.
    emulation: Mapping[str, IslandEmulation] = field(default_factory=lambda: types.MappingProxyType({}))
    source: str | None = None  # file it came from, None when built in code

    def __post_init__(self) -> None:
        islands = tuple(self.islands)
        if not islands:
            raise ConfigError("a cluster needs at least one island", field="islands", value=list(islands),
                              fix="add an island with name, device, nodes and gpus_per_node")
        seen: dict[str, int] = {}
        for i, island in enumerate(islands):
            if island.name in seen:
                raise ConfigError(f"duplicate island name (also islands[{seen[island.name]}])",
                                  field=f"islands[{i}].name", value=island.name,
                                  fix="give every island a unique name")
            seen[island.name] = i
        total = sum(island.num_gpus for island in islands)
        if total > MAX_CLUSTER_GPUS:
            raise ConfigError(f"the islands hold {total:,} GPUs in all, more than the limit of {MAX_CLUSTER_GPUS:,}",
                              field="islands", value=total,
                              fix="check the nodes and gpus_per_node counts (a typo adds digits)")
        object.__setattr__(self, "islands", islands)
        object.__setattr__(self, "links", self._checked_links(tuple(self.links), seen))
        object.__setattr__(self, "emulation", self._checked_emulation(dict(self.emulation), seen))

    def _checked_links(self, links: tuple[LinkSpec, ...], names: Mapping[str, int]) -> tuple[LinkSpec, ...]:
        pairs: dict[frozenset[str], int] = {}
        for i, link in enumerate(links):
            for end in link.between:
                if end not in names:
                    raise ConfigError("link names an unknown island", field=f"links[{i}].between", value=end,
                                      fix=suggest(end, names, what="island names"))
            pair = frozenset(link.between)
            if pair in pairs:
                raise ConfigError(f"duplicate link (also links[{pairs[pair]}])", field=f"links[{i}].between",
                                  value=list(link.between), fix="keep one link per pair of islands")
            pairs[pair] = i
        for a, b in itertools.combinations(names, 2):
            if frozenset((a, b)) not in pairs:
                raise ConfigError("no link between these two islands", field="links", value=[a, b],
                                  fix=f"add '- {{between: [{a}, {b}], bandwidth_gbps: ...}}' under links:, "
                                      "or a default_link: {bandwidth_gbps: ...} block for all missing pairs")
        return links

    @staticmethod
    def _checked_emulation(
        emulation: dict[str, IslandEmulation], names: Mapping[str, int]
    ) -> Mapping[str, IslandEmulation]:
        for name, settings in emulation.items():
            if name not in names:
                raise ConfigError("emulation names an unknown island", field=join("emulation", name), value=name,
                                  fix=suggest(name, names, what="island names"))
            if not isinstance(settings, IslandEmulation):
                raise ConfigError("must be an IslandEmulation", field=join("emulation", name), value=settings,
                                  fix="write {slowdown: 1.5}")
        if emulation:
            emulation = {n: emulation.get(n, IslandEmulation()) for n in names}
        return types.MappingProxyType(emulation)

    def island(self, name: str) -> IslandSpec:
        for island in self.islands:
            if island.name == name:
                return island
        raise KeyError(f"no island {name!r}: {suggest(name, self.island_names, what='island names')}")

    def link(self, a: str, b: str) -> LinkSpec | None:
        """The link joining islands ``a`` and ``b`` in either order; None when a == b or none exists."""
        if a == b:
            return None
        return next((link for link in self.links if link.joins(a, b)), None)

    @property
    def island_names(self) -> tuple[str, ...]:
        return tuple(island.name for island in self.islands)

    @property
    def num_gpus(self) -> int:
        return sum(island.num_gpus for island in self.islands)

    @property
    def peak_tflops(self) -> float:
        """Aggregate dense peak of the cluster, TFLOP/s."""
        return sum(island.peak_tflops for island in self.islands)

    @property
    def memory_gib(self) -> float:
        """Aggregate device memory of the cluster, GiB."""
        return sum(island.memory_gib for island in self.islands)

    @property
    def emulated(self) -> bool:
        return bool(self.emulation)

    def slowdown(self, name: str) -> float:
        """Emulation slowdown of an island; 1.0 when the cluster is not emulated."""
        self.island(name)  # unknown names are a bug in the caller: fail loudly
        settings = self.emulation.get(name)
        return settings.slowdown if settings is not None else 1.0

    def emulation_clock(self, name: str) -> str:
        """What an island's emulated slowdown multiplies (IslandEmulation.clock); "wall" when not emulated."""
        self.island(name)
        settings = self.emulation.get(name)
        return settings.clock if settings is not None else "wall"

    def gpus_by_device_type(self) -> dict[str, int]:
        """Device type name -> number of GPUs, in order of first appearance."""
        counts: dict[str, int] = {}
        for island in self.islands:
            counts[island.device.name] = counts.get(island.device.name, 0) + island.num_gpus
        return counts
