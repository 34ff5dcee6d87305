"""Communication times for known rings, links and placements."""

import pytest

from megatron_het.cluster import CATALOG, ClusterSpec, ConfigError, IslandSpec, LinkSpec, ModelSpec
from megatron_het.perf.comm import (
    activation_message_bytes,
    chain_time,
    distributed_optimizer_share,
    dp_gradient_reduction,
    p2p_channel,
    p2p_time,
    ring_all_gather_time,
    ring_all_reduce_time,
    ring_reduce_scatter_time,
    sharded_gradient_reduction,
    tp_layer_comm_times,
)

GB = 1e9
A100_POD = IslandSpec(name="a100", device=CATALOG["A100-80GB"], nodes=4, gpus_per_node=8,
                      inter_node_bandwidth_gbps=200.0)
A100_BOX = IslandSpec(name="a100-box", device=CATALOG["A100-80GB"], nodes=1, gpus_per_node=8)
MI300 = IslandSpec(name="mi300", device=CATALOG["MI300X"], nodes=2, gpus_per_node=8, inter_node_bandwidth_gbps=400.0)
CLUSTER = ClusterSpec(
    islands=(A100_POD, A100_BOX, MI300),
    links=(LinkSpec(between=("a100", "a100-box"), bandwidth_gbps=100.0, latency_us=10.0),
           LinkSpec(between=("a100", "mi300"), bandwidth_gbps=100.0, latency_us=10.0),
           LinkSpec(between=("a100-box", "mi300"), bandwidth_gbps=50.0, latency_us=20.0)),
)
GPT = ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=2048, vocab_size=50304)


def test_ring_collectives_known_values():
    # 1 GB over 4 ranks at 100 Gbit/s = 12.5 GB/s, 5 us per step
    assert ring_all_reduce_time(GB, n=4, bandwidth_gbps=100, latency_us=5) == pytest.approx(6 * 5e-6 + 1.5 * 0.08)
    assert ring_all_gather_time(GB, n=4, bandwidth_gbps=100, latency_us=5) == pytest.approx(3 * 5e-6 + 0.75 * 0.08)
    assert ring_reduce_scatter_time(GB, n=4, bandwidth_gbps=100, latency_us=5) == pytest.approx(0.060015)
    assert chain_time(GB, n=4, bandwidth_gbps=100, latency_us=5) == pytest.approx(3 * 5e-6 + 0.08)
    assert ring_all_reduce_time(GB, n=1, bandwidth_gbps=100, latency_us=5) == 0.0


def test_ring_validation_names_field():
    with pytest.raises(ConfigError, match=r"bandwidth_gbps: must be > 0 \(got 0\)"):
        ring_all_reduce_time(GB, n=2, bandwidth_gbps=0, latency_us=5)


def test_tp_comm_inside_node_and_across_nodes():
    # 2*s*b*h = 2*2048*1*1024 = 4194304 bytes; tp=8 inside the node (NVLink 2400 Gbit/s, 2 us):
    # one all-reduce = 14*2e-6 + 1.75*4194304/300e9
    one = 14 * 2e-6 + 1.75 * 4_194_304 / 300e9
    t = tp_layer_comm_times(GPT, A100_POD, micro_batch_size=1, tp=8)
    assert (t.forward_s, t.backward_s) == (pytest.approx(2 * one), pytest.approx(2 * one))
    sp = tp_layer_comm_times(GPT, A100_POD, micro_batch_size=1, tp=8, sequence_parallel=True)
    assert sp.forward_s == pytest.approx(t.forward_s)
    # tp=16 spans two nodes: the 200 Gbit/s inter-node network and 5 us steps
    wide = tp_layer_comm_times(GPT, A100_POD, micro_batch_size=1, tp=16)
    assert wide.forward_s == pytest.approx(2 * (30 * 5e-6 + 2 * 15 / 16 * 4_194_304 / 25e9))
    full = tp_layer_comm_times(GPT, A100_POD, micro_batch_size=1, tp=8, recompute="full")
    assert full.backward_s == pytest.approx(4 * one)
    assert tp_layer_comm_times(GPT, A100_POD, micro_batch_size=1, tp=1).forward_s == 0.0


def test_activation_message_bytes():
    assert activation_message_bytes(GPT, micro_batch_size=2) == 8_388_608
    assert activation_message_bytes(GPT, micro_batch_size=2, tp=4, sequence_parallel=True) == 2_097_152


def test_p2p_paths():
    nbytes = 8_388_608
    assert p2p_time(nbytes, CLUSTER, src="a100", dst="a100", same_node=True) == pytest.approx(2e-6 + nbytes / 300e9)
    assert p2p_time(nbytes, CLUSTER, src="a100", dst="a100") == pytest.approx(5e-6 + nbytes / 25e9)
    assert p2p_time(nbytes, CLUSTER, src="a100", dst="a100-box") == pytest.approx(10e-6 + nbytes / 12.5e9)
    # NVIDIA -> AMD is staged through host: 1/B = 1/100 + 2/200 -> 50 Gbit/s effective
    staged = p2p_channel(CLUSTER, src="a100", dst="mi300")
    assert staged.host_staged and staged.bandwidth_gbps == pytest.approx(50.0)
    assert p2p_time(nbytes, CLUSTER, src="mi300", dst="a100") == pytest.approx(10e-6 + nbytes / 6.25e9)


def test_dp_reduction_single_island_is_flat_ring():
    r = dp_gradient_reduction(GB, CLUSTER, replica_islands=["a100"] * 4)
    assert r.islands == 1 and r.inter_island_s == 0.0 and r.broadcast_s == 0.0
    assert r.total_s == pytest.approx(6 * 5e-6 + 1.5 * GB / 25e9)  # inter-node network, 200 Gbit/s
    box = dp_gradient_reduction(GB, CLUSTER, replica_islands=["a100-box"] * 2)
    assert box.total_s == pytest.approx(2 * 2e-6 + 1.0 * GB / 300e9)  # single node: NVLink


def test_dp_reduction_across_vendors_is_sharded():
    """NVIDIA + AMD: the het communicator's sharded form. a100 x3 + mi300 x2: 2 shards."""
    r = dp_gradient_reduction(GB, CLUSTER, replica_islands=["a100", "a100", "a100", "mi300", "mi300"])
    assert r == sharded_gradient_reduction(GB, CLUSTER, replica_islands=["a100"] * 3 + ["mi300"] * 2)
    # a100: two chains of GB/2 at once = one chain of GB over 25 GB/s: 2*5e-6 + 0.04; mi300: one chain
    # of GB over 50 GB/s: 5e-6 + 0.02; the slowest island counts
    assert r.reduce_s == pytest.approx(2 * 5e-6 + 0.04)
    assert r.broadcast_s == pytest.approx(2 * 5e-6 + 0.04)
    # each holder all-reduces its GB/2 shard over the host-staged 50 Gbit/s link (ring of 2): half the leaders' bytes
    assert r.inter_island_s == pytest.approx(2 * 10e-6 + (GB / 2) / 6.25e9)
    assert r.total_s == pytest.approx(2 * (2 * 5e-6 + 0.04) + 2 * 10e-6 + 0.08)
    # replicas sharing a node: the chains stripe over their NICs like the flat ring (a100: 2 x 200 Gbit/s)
    paired = dp_gradient_reduction(GB, CLUSTER, replica_islands=["a100"] * 3 + ["mi300"] * 2, ranks_per_node=2)
    assert paired.reduce_s == pytest.approx(max(2 * 5e-6 + GB / 50e9, 5e-6 + GB / 100e9))
    three = dp_gradient_reduction(GB, CLUSTER, replica_islands=["a100", "a100-box", "mi300"])
    # one replica per island: S = 1, the leader form; ring a100 -> a100-box -> mi300 -> a100: slowest
    # is a100-box<->mi300, 50 Gbit/s staged -> 33.3 Gbit/s
    assert three.reduce_s == three.broadcast_s == 0.0
    assert three.inter_island_s == pytest.approx(4 * 20e-6 + 2 * 2 / 3 * GB / (100 / 3 * 1e9 / 8))


def test_dp_reduction_one_library_across_islands_goes_through_leaders():
    """A100 pod + A100 box share NCCL: a native group, priced reduce to a leader, leaders' ring, broadcast."""
    r = dp_gradient_reduction(GB, CLUSTER, replica_islands=["a100"] * 3 + ["a100-box"] * 2)
    # reduce: a100 chain of 3 over 25 GB/s; a100-box chain of 2 over 300 GB/s NVLink
    assert r.reduce_s == r.broadcast_s == pytest.approx(2 * 5e-6 + 0.04)
    assert r.inter_island_s == pytest.approx(2 * 10e-6 + GB / 12.5e9)  # the whole buffer, 100 Gbit/s
    sharded = sharded_gradient_reduction(GB, CLUSTER, replica_islands=["a100"] * 3 + ["a100-box"] * 2)
    assert sharded.inter_island_s == pytest.approx(2 * 10e-6 + (GB / 2) / 12.5e9)  # the what-if


def test_sharded_reduction_shrinks_the_exchange_with_the_smallest_island():
    """The exchange moves GB / (fewest replicas on an island); one island is the flat ring."""
    one = sharded_gradient_reduction(GB, CLUSTER, replica_islands=["a100"] * 4)
    assert one == dp_gradient_reduction(GB, CLUSTER, replica_islands=["a100"] * 4)
    # With 64 replicas per island the exchange is 1/64 of the leaders' (the links' share vanishes);
    # what is left is the islands' own chains (the same as the leader form's).
    many = ["a100"] * 64 + ["mi300"] * 64
    sharded = dp_gradient_reduction(GB, CLUSTER, replica_islands=many)
    assert sharded.inter_island_s == pytest.approx(2 * 10e-6 + (GB / 64) / 6.25e9)
    assert sharded.reduce_s == sharded.broadcast_s == pytest.approx(63 * 5e-6 + GB / 25e9)
    leader_exchange = 2 * 10e-6 + GB / 6.25e9  # what one leader per island would send
    assert sharded.total_s < 0.5 * (2 * (63 * 5e-6 + GB / 25e9) + leader_exchange)
    # the smallest island sets the shard count: 64 + 1 replicas exchange the whole buffer through one rank
    lopsided = dp_gradient_reduction(GB, CLUSTER, replica_islands=["a100"] * 64 + ["mi300"])
    assert lopsided.inter_island_s == pytest.approx(leader_exchange)


def test_distributed_optimizer_share_follows_the_runtime():
    """The runtime (optim/distributed.py) runs the reduce-scatter / all-gather as the bridge's sharded
    all-reduce when the islands mix libraries and each has >= 2 replicas (a whole all-reduce each);
    otherwise as a reduce-scatter / all-gather (half of one)."""
    assert distributed_optimizer_share(CLUSTER, replica_islands=["a100"] * 3 + ["mi300"] * 2) == 1.0
    assert distributed_optimizer_share(CLUSTER, replica_islands=["a100"] * 3 + ["mi300"]) == 0.5  # one shard: leaders
    assert distributed_optimizer_share(CLUSTER, replica_islands=["a100"] * 2 + ["a100-box"] * 2) == 0.5  # native
    assert distributed_optimizer_share(CLUSTER, replica_islands=["mi300"] * 4) == 0.5


def test_dp_reduction_validation():
    with pytest.raises(ConfigError, match=r"replica_islands: needs at least one replica \(got \[\]\)"):
        dp_gradient_reduction(GB, CLUSTER, replica_islands=[])
    with pytest.raises(KeyError, match="a10"):
        dp_gradient_reduction(GB, CLUSTER, replica_islands=["a10"])
