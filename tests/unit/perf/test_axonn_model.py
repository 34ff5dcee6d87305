"""AxoNN 4D communication model: hand-computed volumes and times, overlap credit, grid choice."""

import pytest

from megatron_het.cluster import CATALOG, IslandSpec, ModelSpec
from megatron_het.perf.axonn import axis_channel, best_grid, candidate_grids, chunked_overlap_time, grid_cost
from megatron_het.perf.comm import ring_all_reduce_time
from megatron_het.tp import Grid4D

POD = IslandSpec(name="a100", device=CATALOG["A100-80GB"], nodes=4, gpus_per_node=8, inter_node_bandwidth_gbps=200.0)
TINY = ModelSpec(num_layers=1, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=50304)
BIG = ModelSpec(num_layers=48, hidden_size=8192, num_attention_heads=64, seq_length=2048, vocab_size=50304)


def test_chunked_overlap_time():
    assert chunked_overlap_time(10.0, 10.0, 1) == 20.0  # no overlap
    assert chunked_overlap_time(10.0, 10.0, 4) == pytest.approx(12.5)  # 2.5 + 3*10/4 + 2.5
    assert chunked_overlap_time(4.0, 12.0, 4) == pytest.approx(1.0 + 9.0 + 3.0)  # compute-bound
    with pytest.raises(ValueError, match=r"chunks: must be >= 1, got 0 \(limit 1\)"):
        chunked_overlap_time(1.0, 1.0, 0)


def test_axis_channel_by_span():
    g = Grid4D(x=8, y=2, z=1, data=2)  # x spans 8 ranks (one node), y spans 16 (two nodes)
    assert axis_channel(g, "x", POD).bandwidth_gbps == POD.intra_node_bandwidth_gbps
    assert axis_channel(g, "y", POD).bandwidth_gbps == 200.0
    assert axis_channel(g, "data", POD).bandwidth_gbps == 200.0


def test_volumes_by_hand_one_axis_each():
    tokens = 4096
    h, f = 1024, 4096
    # x=4 only: forward all-reduces of each GEMM's output over x; nothing else communicates
    c = grid_cost(TINY, POD, Grid4D(x=4, y=1, z=1), batch_tokens=tokens)
    out_widths = {"qkv": 3 * h, "projection": h, "fc1": f, "fc2": h}
    # qkv and fc1 split k over x -> all-reduce m*n; projection and fc2 are transposed: k over y=1,
    # n over x, so their forward all-reduce is over y (size 1): free; their backward one over x.
    fwd = sum(2 * tokens * out_widths[n] for n in ("qkv", "fc1"))
    bwd = sum(2 * tokens * k for k in (h, f))  # projection k=h, fc2 k=f: input grads over x
    assert c.volume_bytes["ar_forward"] == pytest.approx(1.5 * fwd)
    assert c.volume_bytes["ar_backward"] == pytest.approx(1.5 * bwd)
    assert c.volume_bytes["ag_weight"] == c.volume_bytes["rs_wgrad"] == c.volume_bytes["ar_data"] == 0.0
    ch = axis_channel(Grid4D(x=4, y=1, z=1), "x", POD)
    expect = sum(ring_all_reduce_time(2 * tokens * out_widths[n], n=4, bandwidth_gbps=ch.bandwidth_gbps,
                                      latency_us=ch.latency_us) for n in ("qkv", "fc1"))
    assert c.comm_s["ar_forward"] == pytest.approx(expect)
    assert c.exposed_s == pytest.approx(sum(c.comm_s.values()))


def test_depth_axis_is_weight_traffic_only():
    tokens = 4096
    c = grid_cost(TINY, POD, Grid4D(x=1, y=1, z=4), batch_tokens=tokens)
    weights = 2 * (1024 * 3072 + 1024 * 1024 + 1024 * 4096 + 4096 * 1024)  # bf16 bytes of the 4 GEMMs
    assert c.volume_bytes["ag_weight"] == pytest.approx(0.75 * weights)
    assert c.volume_bytes["rs_wgrad"] == pytest.approx(0.75 * weights)
    assert c.volume_bytes["ar_forward"] == c.volume_bytes["ar_backward"] == 0.0
    assert c.state_bytes_per_gpu == pytest.approx(weights / 2 / 4 * 18)  # 2+4+12 bytes per parameter


def test_overlap_never_increases_exposed_time():
    for c in candidate_grids(BIG, POD, 32, batch_tokens=2048 * 64):
        assert 0.0 <= c.exposed_overlap_s <= c.exposed_s + 1e-12
        assert c.exposed_overlap_s >= c.comm_s["ar_forward"] - 1e-12  # the forward all-reduce stays exposed


def test_best_grid_minimises_exposed_time_and_respects_memory():
    cands = candidate_grids(BIG, POD, 32, batch_tokens=2048 * 64)
    assert all(c.state_bytes_per_gpu <= 0.5 * 80 * 2**30 for c in cands)
    assert all(c.grid.data < 32 for c in cands)  # 48 layers of h=8192 do not fit one GPU
    best = best_grid(BIG, POD, 32, batch_tokens=2048 * 64)
    assert best.exposed_overlap_s == min(c.exposed_overlap_s for c in cands)
    best_plain = best_grid(BIG, POD, 32, batch_tokens=2048 * 64, overlap=False)
    assert best_plain.exposed_s == min(c.exposed_s for c in cands)
    assert best.exposed_overlap_s <= best_plain.exposed_overlap_s


def test_grid_cost_validation_messages():
    with pytest.raises(ValueError, match=r"batch_tokens: 1000 must be a multiple of data\*z = 1\*3 = 3"):
        grid_cost(TINY, POD, Grid4D(x=1, y=1, z=3), batch_tokens=1000)
    with pytest.raises(ValueError, match=r"grid: 64 ranks exceed the island's 32 GPUs \(limit 32\)"):
        grid_cost(TINY, POD, Grid4D(x=8, y=8, z=1), batch_tokens=4096)
    with pytest.raises(ValueError, match=r"gpus: no grid of 1 ranks fits"):
        best_grid(BIG, POD, 1, batch_tokens=2048)


def test_gloo_reduce_scatter_priced_as_whole_buffer_all_reduce():
    """torch's gloo backend all-reduces the whole buffer for reduce_scatter_tensor: the model prices
    the weight-gradient reduce-scatter on a gloo island as that all-reduce (2x the ring volume)."""
    from megatron_het.perf.axonn import reduce_scatter_kind

    host = IslandSpec(name="host", device=CATALOG["CPU"], nodes=1, gpus_per_node=4)
    assert reduce_scatter_kind(host) == "ar" and reduce_scatter_kind(POD) == "rs"
    grid = Grid4D(x=1, y=1, z=4)
    gloo = grid_cost(TINY, host, grid, batch_tokens=4096, bytes_per_element=4)
    assert gloo.volume_bytes["rs_wgrad"] == pytest.approx(2 * gloo.volume_bytes["ag_weight"])
    ring = grid_cost(TINY, POD, grid, batch_tokens=4096, bytes_per_element=4)
    assert ring.volume_bytes["rs_wgrad"] == pytest.approx(ring.volume_bytes["ag_weight"])


def test_collective_links_price_each_kind_on_intra_node_axes_only():
    """A host profile's per-collective links replace the island's intra-node link collective by
    collective; axes that cross nodes keep the inter-node link."""
    from megatron_het.perf.axonn import CollectiveLinks
    from megatron_het.perf.comm import Channel, ring_all_gather_time

    slow_ag = Channel(bandwidth_gbps=1.0, latency_us=1000.0, host_staged=False)
    same = Channel(bandwidth_gbps=POD.intra_node_bandwidth_gbps, latency_us=POD.intra_node_latency_us,
                   host_staged=False)
    links = CollectiveLinks(all_gather=slow_ag, all_reduce=same, reduce_scatter=same)
    grid = Grid4D(x=2, y=1, z=4)  # x and z inside one 8-GPU node
    base = grid_cost(TINY, POD, grid, batch_tokens=4096)
    prof = grid_cost(TINY, POD, grid, batch_tokens=4096, links=links)
    weights = 2 * (1024 * 3072 + 1024 * 1024 + 1024 * 4096 + 4096 * 1024) / 2  # bf16, blocks over x*y=2
    expect = sum(ring_all_gather_time(2 * n * k / 2, n=4, bandwidth_gbps=1.0, latency_us=1000.0)
                 for n, k in ((3072, 1024), (1024, 1024), (4096, 1024), (1024, 4096)))
    assert sum(2 * n * k / 2 for n, k in ((3072, 1024), (1024, 1024), (4096, 1024), (1024, 4096))) == weights
    assert prof.comm_s["ag_weight"] == pytest.approx(expect)
    for key in ("ar_forward", "ar_backward", "rs_wgrad"):
        assert prof.comm_s[key] == pytest.approx(base.comm_s[key])
    assert prof.volume_bytes == base.volume_bytes  # links change times, never bytes
    # z spans 16 ranks = two nodes: the all-gather stays on the inter-node link
    wide = Grid4D(x=4, y=1, z=4)
    assert grid_cost(TINY, POD, wide, batch_tokens=4096, links=links).comm_s["ag_weight"] == pytest.approx(
        grid_cost(TINY, POD, wide, batch_tokens=4096).comm_s["ag_weight"])


def test_collective_links_by_group_size_price_each_axis_by_its_group_size():
    """With links per group size, a 2-rank axis is priced over the 2-rank link and a 4-rank axis over
    the 4-rank one (each against the ring formula by hand); sizes without their own links use the
    pooled fields."""
    from megatron_het.perf.axonn import CollectiveLinks
    from megatron_het.perf.comm import Channel, ring_all_gather_time, ring_all_reduce_time

    def ch(bw, lat):
        return Channel(bandwidth_gbps=bw, latency_us=lat, host_staged=False)

    pooled, two, four = ch(5.0, 1000.0), ch(2.0, 3000.0), ch(8.0, 500.0)
    links = CollectiveLinks(all_gather=pooled, all_reduce=pooled, reduce_scatter=pooled,
                            by_group_size={2: CollectiveLinks(all_gather=two, all_reduce=two, reduce_scatter=two),
                                           4: CollectiveLinks(all_gather=four, all_reduce=four, reduce_scatter=four)})
    grid = Grid4D(x=2, y=1, z=4)  # forward all-reduce over x (2 ranks), weight all-gather over z (4 ranks)
    cost = grid_cost(TINY, POD, grid, batch_tokens=4096, bytes_per_element=4, links=links)
    dims = {"qkv": (3072, 1024, False), "projection": (1024, 1024, True), "fc1": (4096, 1024, False),
            "fc2": (1024, 4096, True)}  # (n, k, transposed)
    ag = sum(ring_all_gather_time(4 * n * k / 2, n=4, bandwidth_gbps=8.0, latency_us=500.0) for n, k, _ in dims.values())
    m = 4096 // 4  # tokens per z rank
    ar = sum(ring_all_reduce_time(4 * m * n, n=2, bandwidth_gbps=2.0, latency_us=3000.0)
             for n, _, t in dims.values() if not t)  # x splits k of the normal layers: their forward reduces
    assert cost.comm_s["ag_weight"] == pytest.approx(TINY.num_layers * ag)
    # the transposed layers' forward all-reduce runs over y (1 rank): free, so only the normal layers count
    assert cost.comm_s["ar_forward"] == pytest.approx(TINY.num_layers * ar)
    assert links.for_item("ar_forward", ranks=8) is pooled
    with pytest.raises(ValueError, match=r"by_group_size: needs group sizes >= 2 .* Fix"):
        CollectiveLinks(all_gather=pooled, all_reduce=pooled, reduce_scatter=pooled,
                        by_group_size={1: CollectiveLinks(all_gather=two, all_reduce=two, reduce_scatter=two)})
