"""Communication times: ring collectives, tensor-parallel traffic, stage-to-stage sends, and the
data-parallel gradient reduction (flat inside one island, hierarchical across islands).

Model (alpha-beta, Thakur et al. 2005, "Optimization of Collective Communication Operations in
MPICH"; the ring variants NCCL uses): a collective over ``n`` ranks costs
``steps * alpha + factor * bytes / bandwidth``:

================  ==========  ================
collective        steps       factor
================  ==========  ================
all-reduce        2(n-1)      2(n-1)/n
all-gather        n-1         (n-1)/n
reduce-scatter    n-1         (n-1)/n
reduce/broadcast  n-1         1   (pipelined chain, large messages)
================  ==========  ================

``bytes`` is the full buffer (the gathered output, the reduce-scatter input). Bandwidths are per
GPU, one direction, in Gbit/s as in the cluster file; everything returned is in seconds.

Across vendors (e.g. NVIDIA <-> AMD) no collective library talks to both, so data is staged
through host memory: a device->host copy on the sender and a host->device copy on the receiver,
each at ``HOST_STAGING_BANDWIDTH_GBPS`` (PCIe Gen4 x16 is 256 Gbit/s raw per direction; ~200
sustained), not overlapped with the network transfer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from megatron_het.cluster import DEFAULT_INTRA_NODE_LATENCY_US, ClusterSpec, ConfigError, IslandSpec, ModelSpec
from megatron_het.perf.flops import Recompute, check_recompute, check_tp

__all__ = [
    "HOST_STAGING_BANDWIDTH_GBPS",
    "INTRA_NODE_LATENCY_US",
    "Channel",
    "CommTimes",
    "GradientReduction",
    "spans_collective_libraries",
    "bytes_per_s",
    "ring_all_reduce_time",
    "ring_all_gather_time",
    "ring_reduce_scatter_time",
    "chain_time",
    "tp_channel",
    "moe_dispatch_times",
    "island_channel",
    "tp_layer_comm_times",
    "moe_all_to_all_times",
    "activation_message_bytes",
    "p2p_channel",
    "p2p_time",
    "dp_gradient_reduction",
    "sharded_gradient_reduction",
    "distributed_optimizer_share",
]

HOST_STAGING_BANDWIDTH_GBPS = 200.0  # sustained PCIe Gen4 x16 device<->host copy, one direction
INTRA_NODE_LATENCY_US = DEFAULT_INTRA_NODE_LATENCY_US  # an island's default; the cluster file may set its own


@dataclass(frozen=True, kw_only=True)
class Channel:
    """The effective link a transfer or collective runs over."""

    bandwidth_gbps: float  # effective per-GPU bandwidth, Gbit/s (host staging already folded in)
    latency_us: float  # per message / per ring step, microseconds
    host_staged: bool  # True when crossing vendors through host memory


@dataclass(frozen=True, kw_only=True)
class CommTimes:
    """Communication seconds attached to the forward and the backward of one micro-batch."""

    forward_s: float  # during the forward pass
    backward_s: float  # during the backward pass (including recomputation's forward traffic)


@dataclass(frozen=True, kw_only=True)
class GradientReduction:
    """Phases of one stage's gradient reduction among its replicas, seconds."""

    reduce_s: float  # inside islands to the rank(s) that exchange (slowest island); the whole flat
    # all-reduce for one island
    inter_island_s: float  # the exchange between islands (one shard per holder, or the whole buffer
    # among one leader per island); 0 for one island
    broadcast_s: float  # back inside each island (slowest island); 0 for one island
    islands: int  # number of islands the replicas span

    @property
    def total_s(self) -> float:
        return self.reduce_s + self.inter_island_s + self.broadcast_s


def bytes_per_s(bandwidth_gbps: float) -> float:
    return bandwidth_gbps * 1e9 / 8


def _check(nbytes: float, n: int, bandwidth_gbps: float) -> None:
    if nbytes < 0:
        raise ConfigError("must be >= 0", field="nbytes", value=nbytes, fix="pass a message size in bytes")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError("must be an integer >= 1", field="n", value=n, fix="pass the number of ranks")
    if not bandwidth_gbps > 0:
        raise ConfigError("must be > 0", field="bandwidth_gbps", value=bandwidth_gbps,
                          fix="pass the per-GPU link bandwidth in Gbit/s")


def ring_all_reduce_time(nbytes: float, *, n: int, bandwidth_gbps: float, latency_us: float) -> float:
    _check(nbytes, n, bandwidth_gbps)
    if n == 1:
        return 0.0
    return 2 * (n - 1) * latency_us * 1e-6 + 2 * (n - 1) / n * nbytes / bytes_per_s(bandwidth_gbps)


def ring_all_gather_time(nbytes: float, *, n: int, bandwidth_gbps: float, latency_us: float) -> float:
    """``nbytes`` is the gathered (full) buffer."""
    _check(nbytes, n, bandwidth_gbps)
    if n == 1:
        return 0.0
    return (n - 1) * latency_us * 1e-6 + (n - 1) / n * nbytes / bytes_per_s(bandwidth_gbps)


def ring_reduce_scatter_time(nbytes: float, *, n: int, bandwidth_gbps: float, latency_us: float) -> float:
    """``nbytes`` is the full input buffer; same cost as an all-gather of it."""
    return ring_all_gather_time(nbytes, n=n, bandwidth_gbps=bandwidth_gbps, latency_us=latency_us)


def chain_time(nbytes: float, *, n: int, bandwidth_gbps: float, latency_us: float) -> float:
    """Pipelined reduce-to-one or broadcast-from-one along a chain of ``n`` ranks."""
    _check(nbytes, n, bandwidth_gbps)
    if n == 1:
        return 0.0
    return (n - 1) * latency_us * 1e-6 + nbytes / bytes_per_s(bandwidth_gbps)


def _staged(link_gbps: float, latency_us: float, copies: int) -> Channel:
    """Fold ``copies`` serial host copies into one effective bandwidth: 1/B = 1/B_link + copies/B_pcie."""
    if copies == 0:
        return Channel(bandwidth_gbps=link_gbps, latency_us=latency_us, host_staged=False)
    effective = 1.0 / (1.0 / link_gbps + copies / HOST_STAGING_BANDWIDTH_GBPS)
    return Channel(bandwidth_gbps=effective, latency_us=latency_us, host_staged=True)


def island_channel(island: IslandSpec, *, same_node: bool) -> Channel:
    """The link between two GPUs of ``island``: its intra-node one, or its inter-node network."""
    if same_node:
        return Channel(bandwidth_gbps=island.intra_node_bandwidth_gbps, latency_us=island.intra_node_latency_us,
                       host_staged=False)
    return Channel(bandwidth_gbps=island.inter_node_bandwidth_gbps, latency_us=island.inter_node_latency_us,
                   host_staged=False)


def tp_channel(island: IslandSpec, tp: int) -> Channel:
    """Tensor parallelism runs inside a node when ``tp <= gpus_per_node``, else over the slower
    inter-node network (the ring's bottleneck)."""
    return island_channel(island, same_node=tp <= island.gpus_per_node)


def tp_layer_comm_times(model: ModelSpec, island: IslandSpec, *, micro_batch_size: int, tp: int,
                        seq_length: int | None = None, sequence_parallel: bool = False,
                        recompute: Recompute = "none", element_bytes: int = 2) -> CommTimes:
    """Tensor-parallel traffic of one layer for one micro-batch (Megatron-LM, Shoeybi et al. 2019).

    Without sequence parallelism: two all-reduces of the ``s*b*h`` bf16 activation in forward
    (after the attention projection and fc2) and two in backward (input gradients of QKV and fc1).
    With it: each all-reduce becomes an all-gather plus a reduce-scatter of the same buffer, which
    costs the same in a ring. Full recomputation repeats the forward traffic during backward.
    ``element_bytes`` is 4 for fp32/tf32 runs. An MoE layer: the attention's pair and its shared
    expert's, if it has one; its token dispatcher's traffic is :func:`moe_dispatch_times`'.
    """
    check_tp(model, tp)
    check_recompute(recompute)
    if tp == 1:
        return CommTimes(forward_s=0.0, backward_s=0.0)
    s = model.seq_length if seq_length is None else seq_length
    nbytes = element_bytes * s * micro_batch_size * model.hidden_size
    ch = tp_channel(island, tp)
    args = dict(n=tp, bandwidth_gbps=ch.bandwidth_gbps, latency_us=ch.latency_us)
    if sequence_parallel:
        one = ring_all_gather_time(nbytes, **args) + ring_reduce_scatter_time(nbytes, **args)
    else:
        one = ring_all_reduce_time(nbytes, **args)
    # an MoE layer: the attention's pair, and its shared expert's (an MLP under the same TP and SP)
    forward = (1 + bool(model.moe_shared_expert_intermediate_size)) * one if model.is_moe else 2 * one
    return CommTimes(forward_s=forward, backward_s=forward + (forward if recompute == "full" else 0.0))


def moe_dispatch_times(model: ModelSpec, *, micro_batch_size: int, tp: int, ep: int, etp: int, tp_link: Channel,
                       grid_link: Channel, seq_length: int | None = None, sequence_parallel: bool = False,
                       recompute: Recompute = "none", element_bytes: int = 2) -> CommTimes:
    """An MoE layer's token-dispatcher traffic for one micro-batch (beside the attention's TP pair).

    A rank routes ``s x b`` tokens (``s/tp`` under sequence parallelism). megatron-core's dispatchers
    (transformer/moe/token_dispatcher.py), forward; backward mirrors it, full recomputation repeats it:

    - alltoall: the ``topk`` copies exchanged over EP (:func:`moe_all_to_all_times`, ``grid_link``), then
      what arrived all-gathered over the ``etp`` expert-TP ranks and the experts' output reduce-scattered
      back (dispatch_postprocess / combine_preprocess), a buffer of ``topk x tokens x etp`` hidden states;
    - allgather: the hidden states all-gathered over the expert grid (``etp x ep`` ranks) and the output
      reduce-scattered back, ``tokens x etp x ep`` of them, no ``topk`` factor (the experts read them in
      place).

    Expert-TP runs inside the stage's TP group (``tp_link``) when ``etp <= tp``, else across the expert
    domain's replicas (``grid_link``: plan/experts.py's grid, ``predict.expert_channels``)."""
    zero = CommTimes(forward_s=0.0, backward_s=0.0)
    if not model.is_moe:
        return zero
    s = model.seq_length if seq_length is None else seq_length
    tokens = (s // tp if sequence_parallel else s) * micro_batch_size
    hidden = element_bytes * tokens * model.hidden_size  # this rank's tokens' hidden states

    def pair(nbytes: float, n: int, link: Channel) -> float:
        if n == 1:
            return 0.0
        args = dict(n=n, bandwidth_gbps=link.bandwidth_gbps, latency_us=link.latency_us)
        return ring_all_gather_time(nbytes, **args) + ring_reduce_scatter_time(nbytes, **args)

    if model.moe_token_dispatcher_type == "allgather":
        grid = etp * ep
        forward = pair(hidden * grid, grid, tp_link if grid <= tp else grid_link)
    else:
        a2a = moe_all_to_all_times(model, grid_link, micro_batch_size=micro_batch_size, ep=ep, tp=tp,
                                   seq_length=seq_length, sequence_parallel=sequence_parallel,
                                   element_bytes=element_bytes).forward_s
        forward = a2a + pair(model.moe_router_topk * hidden * etp, etp, tp_link if etp <= tp else grid_link)
    if forward == 0.0:
        return zero
    return CommTimes(forward_s=forward, backward_s=forward + (forward if recompute == "full" else 0.0))


def moe_all_to_all_times(model: ModelSpec, channel: Channel, *, micro_batch_size: int, ep: int, tp: int = 1,
                         seq_length: int | None = None, sequence_parallel: bool = False,
                         recompute: Recompute = "none", element_bytes: int = 2) -> CommTimes:
    """Expert parallelism's token exchange in one MoE layer for one micro-batch (megatron-core's
    alltoall dispatcher): each token's hidden state goes to the ranks holding its ``topk`` experts and
    comes back (dispatch and combine, two all-to-alls forward, their gradients two backward; full
    recomputation repeats the forward's). A rank routes ``s x b`` tokens (``s/tp`` with sequence
    parallelism); under balanced routing ``(ep - 1) / ep`` of the ``topk`` copies leave the rank, sent
    pairwise (``ep - 1`` messages) over ``channel``. Priced as not overlapped with compute (megatron-core
    runs them on the compute stream); routing imbalance is left out."""
    if ep == 1 or not model.is_moe:
        return CommTimes(forward_s=0.0, backward_s=0.0)
    s = model.seq_length if seq_length is None else seq_length
    tokens = (s // tp if sequence_parallel else s) * micro_batch_size
    off_rank = element_bytes * tokens * model.moe_router_topk * model.hidden_size * (ep - 1) / ep
    one = (ep - 1) * channel.latency_us * 1e-6 + off_rank / bytes_per_s(channel.bandwidth_gbps)
    forward = 2 * one
    return CommTimes(forward_s=forward, backward_s=2 * one + (forward if recompute == "full" else 0.0))


def activation_message_bytes(model: ModelSpec, *, micro_batch_size: int, seq_length: int | None = None,
                             tp: int = 1, sequence_parallel: bool = False, element_bytes: int = 2) -> int:
    """Bytes each tensor-parallel rank sends to the next stage: the ``s*b*h`` hidden states (2 bytes
    an element, 4 in fp32/tf32 runs), or its ``1/tp`` sequence shard with sequence parallelism. The
    gradient sent back is the same size."""
    check_tp(model, tp)
    s = model.seq_length if seq_length is None else seq_length
    s_local = s // tp if sequence_parallel else s
    return element_bytes * s_local * micro_batch_size * model.hidden_size


def p2p_channel(cluster: ClusterSpec, *, src: str, dst: str, same_node: bool = False) -> Channel:
    """The link between a rank on island ``src`` and one on island ``dst``.

    Same island: the intra-node link when ``same_node`` else the island's inter-node network.
    Different islands: the cluster's link between them, host-staged when the vendors differ (one
    copy per GPU end; a CPU end needs none).
    """
    a, b = cluster.island(src), cluster.island(dst)
    if src == dst:
        return island_channel(a, same_node=same_node)
    link = cluster.link(src, dst)
    if link is None:
        raise ConfigError("no link between these islands", field="links", value=[src, dst],
                          fix=f"add a link between {src} and {dst} to the cluster file")
    copies = 0
    if a.device.vendor != b.device.vendor:
        copies = sum(1 for isl in (a, b) if not isl.device.is_host)
    return _staged(link.bandwidth_gbps, link.latency_us, copies)


def p2p_time(nbytes: float, cluster: ClusterSpec, *, src: str, dst: str, same_node: bool = False) -> float:
    """Seconds to send ``nbytes`` from a rank on island ``src`` to one on ``dst``: ``alpha + bytes/B``."""
    ch = p2p_channel(cluster, src=src, dst=dst, same_node=same_node)
    _check(nbytes, 1, ch.bandwidth_gbps)
    return ch.latency_us * 1e-6 + nbytes / bytes_per_s(ch.bandwidth_gbps)


def _dp_channel(island: IslandSpec) -> Channel:
    # Replicas of a stage sit on different nodes as soon as the island has several (TP fills a node
    # first, pipeline stages and replicas spread over nodes), so the inter-node network is the
    # bottleneck; a single-node island reduces over its intra-node link.
    return island_channel(island, same_node=island.nodes == 1)


def _replica_counts(cluster: ClusterSpec, replica_islands: Sequence[str]) -> dict[str, int]:
    if not replica_islands:
        raise ConfigError("needs at least one replica", field="replica_islands", value=list(replica_islands),
                          fix="pass the island name of each replica of the stage")
    counts: dict[str, int] = {}
    for name in replica_islands:
        cluster.island(name)  # unknown names fail loudly
        counts[name] = counts.get(name, 0) + 1
    return counts


def _island_ring_channel(island: IslandSpec, ranks_per_node: int) -> Channel:
    # NCCL stripes a ring's channels over the NICs of the replicas sharing a node (see below)
    ch = _dp_channel(island)
    if island.nodes > 1 and ranks_per_node > 1:
        ch = Channel(bandwidth_gbps=min(island.intra_node_bandwidth_gbps, ranks_per_node * ch.bandwidth_gbps),
                     latency_us=ch.latency_us, host_staged=ch.host_staged)
    return ch


def _cross_ring(cluster: ClusterSpec, names: list[str]) -> Channel:
    """The ring among one rank per island: its slowest link and largest latency (host-staged
    where vendors mix)."""
    ring = [p2p_channel(cluster, src=a, dst=b) for a, b in zip(names, names[1:] + names[:1]) if a != b]
    return Channel(bandwidth_gbps=min(c.bandwidth_gbps for c in ring), latency_us=max(c.latency_us for c in ring),
                   host_staged=any(c.host_staged for c in ring))


def spans_collective_libraries(cluster: ClusterSpec, islands: Iterable[str]) -> bool:
    """True when the islands' devices use more than one collective library (NCCL and RCCL): a group
    over them runs through the runtime's het bridge (comm/), not as one native group."""
    return len({cluster.island(name).device.collective_library for name in islands}) > 1


def dp_gradient_reduction(nbytes: float, cluster: ClusterSpec, *, replica_islands: Sequence[str],
                          ranks_per_node: int = 1) -> GradientReduction:
    """Time to all-reduce ``nbytes`` of one stage rank's gradients among its replicas, as the
    runtime's group for them runs it (runtime/comm_routing.py).

    ``ranks_per_node``: how many of the replicas share one node of a multi-node island (Megatron
    places data-parallel peers next to each other after tensor parallelism). NCCL stripes the ring's
    channels over every NIC of the node, so the node's inter-node traffic is carried by that many
    network links at once (the ring's intra-node hops run over the faster intra-node link).

    ``replica_islands`` names the island of each replica's copy of this stage (one entry per
    replica, repeats allowed). One island: a flat ring all-reduce. Islands of several collective
    libraries (NVIDIA and AMD): the `het` communicator's sharded form,
    :func:`sharded_gradient_reduction`. Islands of one library: a native group spanning them,
    priced hierarchically through one leader per island: reduce to the leader (in parallel; the
    slowest island counts), ring all-reduce among the leaders over the cross-island links (slowest
    link and largest latency in the ring), broadcast back inside each island.
    """
    counts = _replica_counts(cluster, replica_islands)
    if len(counts) == 1:
        (name, n), = counts.items()
        ch = _island_ring_channel(cluster.island(name), ranks_per_node)
        flat = ring_all_reduce_time(nbytes, n=n, bandwidth_gbps=ch.bandwidth_gbps, latency_us=ch.latency_us)
        return GradientReduction(reduce_s=flat, inter_island_s=0.0, broadcast_s=0.0, islands=1)
    if spans_collective_libraries(cluster, counts):
        return sharded_gradient_reduction(nbytes, cluster, replica_islands=replica_islands,
                                          ranks_per_node=ranks_per_node)
    intra = 0.0
    for name, n in counts.items():
        ch = _dp_channel(cluster.island(name))
        intra = max(intra, chain_time(nbytes, n=n, bandwidth_gbps=ch.bandwidth_gbps, latency_us=ch.latency_us))
    ring = _cross_ring(cluster, list(counts))
    inter = ring_all_reduce_time(nbytes, n=len(counts), bandwidth_gbps=ring.bandwidth_gbps, latency_us=ring.latency_us)
    return GradientReduction(reduce_s=intra, inter_island_s=inter, broadcast_s=intra, islands=len(counts))


def sharded_gradient_reduction(nbytes: float, cluster: ClusterSpec, *, replica_islands: Sequence[str],
                               ranks_per_node: int = 1) -> GradientReduction:
    """The all-reduce of ``nbytes`` as the `het` communicator runs it across islands
    (comm/python_impl.py, csrc/het_backend.cpp): the buffer is cut into ``S = min(n_i)`` shards
    (the fewest replicas on an island); inside every island shard ``j`` is reduced to member ``j``
    (``S`` concurrent pipelined chains of ``nbytes / S``, whose bytes add up to one chain of the
    whole buffer, over the channel of the island's flat ring, ``ranks_per_node`` included);
    member ``j`` of every island all-reduces its ``nbytes / S`` shard over its own
    link (the ``S`` rings run at once, one per rank's link, so the exchange costs one ring of one
    shard); each shard is broadcast back inside the island from its holder (chains again).
    ``S = 1`` is the leader form: chain, leaders' ring of the whole buffer, chain.

    :func:`dp_gradient_reduction` prices a group spanning collective libraries with this; for a
    same-library group across islands (a native ring, priced through one leader per island) it is
    the what-if of sharding the exchange. One island: the flat ring of :func:`dp_gradient_reduction`.
    ``reduce_s``/``broadcast_s`` hold the slowest island's phase, ``inter_island_s`` the exchange."""
    counts = _replica_counts(cluster, replica_islands)
    if len(counts) == 1:
        return dp_gradient_reduction(nbytes, cluster, replica_islands=replica_islands, ranks_per_node=ranks_per_node)
    shards = min(counts.values())
    inside = 0.0  # S chains of nbytes / S each, at once over the same links: one chain of nbytes
    for name, n in counts.items():
        # NCCL runs reduce and broadcast over the same striped channels as its rings
        ch = _island_ring_channel(cluster.island(name), ranks_per_node)
        inside = max(inside, chain_time(nbytes, n=n, bandwidth_gbps=ch.bandwidth_gbps, latency_us=ch.latency_us))
    ring = _cross_ring(cluster, list(counts))
    exchange = ring_all_reduce_time(nbytes / shards, n=len(counts), bandwidth_gbps=ring.bandwidth_gbps,
                                    latency_us=ring.latency_us)
    return GradientReduction(reduce_s=inside, inter_island_s=exchange, broadcast_s=inside, islands=len(counts))


def distributed_optimizer_share(cluster: ClusterSpec, *, replica_islands: Sequence[str]) -> float:
    """What each of the distributed optimizer's two collectives among the replicas (gradient
    reduce-scatter, weight all-gather) costs, as a share of :func:`dp_gradient_reduction`'s
    all-reduce of the same bytes, as the runtime runs them (optim/distributed.py): 1.0 across
    collective libraries when every island has at least 2 replicas, where each runs as the `het`
    bridge's sharded all-reduce of the whole buffer (keeping its slice: each holder's 2(k-1)/k of
    1/S of the buffer crosses, no more than one leader's (k-1)/k of all of it); else 0.5 (a ring
    reduce-scatter or all-gather is half a ring all-reduce, and the bridge's leader-based ones move
    half the leaders' all-reduce bytes)."""
    counts = _replica_counts(cluster, replica_islands)
    bridged = spans_collective_libraries(cluster, counts)
    return 1.0 if bridged and min(counts.values()) > 1 else 0.5
