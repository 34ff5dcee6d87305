"""Put measured communication in place of a cluster file's nominal link figures.

A profile's ``link`` (tools/profile_host.py ``--comm-ranks``) is an alpha-beta channel fitted to
collectives between processes of the host where it was measured. It stands for:
- the intra-node link of every island whose device type is the profile's (same kind of host);
- on an emulated cluster whose islands are all of that device type, every other link too: every
  rank is then a process of this one host, so island-to-island and "inter-node" traffic really
  runs over the same transport (emulation slows compute, not links).
Real multi-node links of a GPU cluster stay as the cluster file describes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from megatron_het.cluster import ClusterSpec
from megatron_het.perf.profile import Profile

__all__ = ["with_measured_links"]


def with_measured_links(cluster: ClusterSpec, profile: Profile | Sequence[Profile] | None) -> ClusterSpec:
    """``cluster`` with measured links substituted (itself when no profile carries one)."""
    profiles = () if profile is None else (profile,) if isinstance(profile, Profile) else tuple(profile)
    measured = {p.device: p.link for p in profiles if p.link is not None}
    if not measured:
        return cluster
    islands = []
    for island in cluster.islands:
        link = measured.get(island.device.name)
        if link is not None:
            island = replace(island, intra_node_bandwidth_gbps=link.bandwidth_gbps,
                             intra_node_latency_us=link.latency_us)
        islands.append(island)
    devices = {i.device.name for i in cluster.islands}
    links = cluster.links
    if cluster.emulated and len(devices) == 1 and next(iter(devices)) in measured:
        host = measured[next(iter(devices))]
        islands = [replace(i, inter_node_bandwidth_gbps=host.bandwidth_gbps, inter_node_latency_us=host.latency_us)
                   for i in islands]
        links = tuple(replace(k, bandwidth_gbps=host.bandwidth_gbps, latency_us=host.latency_us) for k in links)
    return replace(cluster, islands=tuple(islands), links=links)
