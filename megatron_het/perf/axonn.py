"""AxoNN's 4D (x, y, z tensor-parallel x data) communication model, and chunked-overlap timing.

For each matmul ``Y[m, n] = X[m, k] W[n, k]^T`` of a transformer layer on the grid
``Grid4D(x, y, z, data)`` (megatron_het/tp/grid.py; Singh et al. 2024, "A 4D hybrid algorithm to
scale parallel training to thousands of GPUs", §4), with ``g_in``/``g_out`` the axes splitting
``k``/``n`` (x/y, swapped for the transposed layers: projection and fc2), ``m`` the tokens of one
data replica's batch, ``B`` bytes per element, every rank takes part in, per iteration:

======================  ======  =======================  ===========================
collective              axis    buffer (bytes)           when
======================  ======  =======================  ===========================
all-gather weights      z       ``B*n*k/(x*y)``          forward, before the GEMM
all-reduce output       g_in    ``B*m*n/(z*g_out)``      forward, after the GEMM
all-reduce input grad   g_out   ``B*m*k/(z*g_in)``       backward
reduce-scatter wgrad    z       ``B*n*k/(x*y)``          backward
all-reduce wgrad        data    ``B*n*k/(x*y*z)``        backward
======================  ======  =======================  ===========================

Times are the ring collectives of ``perf/comm.py`` over each axis's link (with ``links``, a host
profile's fitted link of that collective kind on intra-node axes), except that on an island
whose collective library is gloo a reduce-scatter is priced as an all-reduce of the whole buffer:
torch's gloo backend implements ``reduce_scatter_tensor`` that way (``ProcessGroupGloo::
reduce_scatter_tensor_coalesced`` clones the input, all-reduces it and copies out this rank's
chunk), twice the ring reduce-scatter's volume plus its latency steps. Rank order is x fastest,
then y, z, data: an axis whose group spans ``stride * size <= gpus_per_node`` ranks stays inside a
node (intra-node link), otherwise it crosses nodes (the island's inter-node link per GPU).

Exposed time without overlap is the sum of all of it. With AxoNN's overlaps: the forward
all-reduce stays exposed (the next GEMM needs it); the input-gradient all-reduce of each GEMM is
hidden behind that GEMM's weight-gradient GEMM ("OAR"); the weight all-gathers are prefetched
behind the forward compute ("OAG"); the weight-gradient reduce-scatters and the data-parallel
all-reduce run behind the rest of the backward ("ORS", bucketed DDP). Each stream is credited
against its own compute independently (a lower bound when links are shared).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

from megatron_het.cluster import GLOO, IslandSpec, ModelSpec
from megatron_het.perf.comm import (
    Channel,
    ring_all_gather_time,
    ring_all_reduce_time,
    ring_reduce_scatter_time,
)
from megatron_het.perf.compute import gemm_time
from megatron_het.perf.flops import Gemm, layer_gemms
from megatron_het.perf.memory import GRAD_BYTES, OPTIMIZER_BYTES, PARAM_BYTES, device_capacity_bytes
from megatron_het.tp.grid import AXES, Grid4D

__all__ = [
    "AXONN_GEMMS",
    "CollectiveLinks",
    "GridCost",
    "axis_channel",
    "best_grid",
    "chunked_overlap_time",
    "candidate_grids",
    "grid_cost",
    "reduce_scatter_kind",
]

# Layer GEMMs the 3D layer distributes (attention's batched per-head GEMMs stay local) and whether
# each runs transposed (AxoNN alternates so a layer's output block is the next one's input block).
AXONN_GEMMS: dict[str, bool] = {"qkv": False, "projection": True, "fc1": False, "fc2": True}


def chunked_overlap_time(comm_s: float, compute_s: float, chunks: int) -> float:
    """Seconds for ``chunks`` pieces of a collective feeding (or fed by) a GEMM, pipelined.

    The first piece's collective (or last piece's) cannot overlap; in between each step costs the
    slower of the two: ``c/k + (k-1)*max(c, g)/k + g/k``. ``chunks=1`` is ``c + g`` (no overlap).
    """
    if chunks < 1:
        raise ValueError(f"chunks: must be >= 1, got {chunks} (limit 1). Fix: pass 1 for no overlap")
    if comm_s < 0 or compute_s < 0:
        raise ValueError(f"comm_s/compute_s: must be >= 0, got {comm_s}, {compute_s} (limit 0). "
                         f"Fix: pass measured or modelled seconds")
    k = chunks
    return comm_s / k + (k - 1) * max(comm_s, compute_s) / k + compute_s / k


def _intra_node(grid: Grid4D, axis: str, island: IslandSpec) -> bool:
    return grid.stride(axis) * getattr(grid, axis) <= island.gpus_per_node


def axis_channel(grid: Grid4D, axis: str, island: IslandSpec) -> Channel:
    """The link an axis's collective runs over: intra-node when its group fits in one node."""
    if _intra_node(grid, axis, island):
        return Channel(bandwidth_gbps=island.intra_node_bandwidth_gbps, latency_us=island.intra_node_latency_us,
                       host_staged=False)
    return Channel(bandwidth_gbps=island.inter_node_bandwidth_gbps, latency_us=island.inter_node_latency_us,
                   host_staged=False)


@dataclass(frozen=True, kw_only=True)
class CollectiveLinks:
    """A host profile's link per collective kind (``perf/link_fit.fit_ring_link`` of timed
    collectives): gloo on CPU runs each kind through different code (the all-gather into a fresh
    flat buffer then copied out, the reduce-scatter as a clone + all-reduce + copy), so one fitted
    link cannot price them all. Applies to the intra-node axes only (it is measured on one host).

    ``by_group_size`` refines it per group size: a ring's step count ``n-1`` does not say what a
    step costs on groups of different sizes (on a 2-core host two 2-rank groups run at once on the
    same cores, so a 4-rank collective costs 1.5-2.8x a 2-rank one, not 3x; NCCL's bus bandwidth
    and latency also depend on the group size and the algorithm it picks for it), so a profile that
    timed several group sizes gives each its own fitted links."""

    all_gather: Channel  # weight all-gathers, priced with the ring all-gather formula
    all_reduce: Channel  # forward, input-gradient and data-parallel all-reduces (ring all-reduce)
    reduce_scatter: Channel  # weight-gradient reduce-scatters, priced with reduce_scatter_kind's formula
    # group size -> the links fitted on groups of that size only; a size not in it uses the fields above
    by_group_size: Mapping[int, CollectiveLinks] = field(default_factory=dict)

    def __post_init__(self):
        for n, sub in self.by_group_size.items():
            if n < 2 or sub.by_group_size:
                raise ValueError(f"by_group_size: needs group sizes >= 2 mapped to links without their own "
                                 f"by_group_size, got size {n} (limit 2). Fix: fit one CollectiveLinks per "
                                 f"group size the profile timed")

    def for_item(self, key: str, ranks: int | None = None) -> Channel:
        """The link of one of ``GridCost.comm_s``'s collectives over a group of ``ranks`` ranks."""
        links = self.by_group_size.get(ranks, self)
        if key == "ag_weight":
            return links.all_gather
        return links.reduce_scatter if key == "rs_wgrad" else links.all_reduce


@dataclass(frozen=True, kw_only=True)
class GridCost:
    """Predicted per-iteration communication of one grid for the whole model, per rank."""

    grid: Grid4D  # the configuration
    volume_bytes: dict[str, float]  # bytes each rank sends, by collective (ring factors applied)
    comm_s: dict[str, float]  # seconds by collective: ag_weight, ar_forward, ar_backward, rs_wgrad, ar_data
    compute_s: float  # forward + backward GEMM seconds of the distributed GEMMs
    exposed_s: float  # communication on the critical path without overlap (= sum of comm_s)
    exposed_overlap_s: float  # with AxoNN's overlaps (module docstring)
    exposed_forward_s: float  # the forward's share of exposed_s (weight all-gathers + forward all-reduces)
    exposed_overlap_forward_s: float  # the forward's share of exposed_overlap_s
    # What tp/linear3d.Linear3D runs: each GEMM's collectives cut into ``chunks`` pieces overlapped
    # with that GEMM's own pieces only (no prefetch across layers), each piece paying the collective's
    # latency steps again: per GEMM, forward
    # ``chunked_overlap_time(ag + ar_fwd, gemm, chunks) - gemm``, backward the same with
    # ``ar_bwd + rs (+ ar_data)`` against the input- and weight-gradient GEMMs.
    exposed_chunked_s: float
    exposed_chunked_forward_s: float  # its forward share
    state_bytes_per_gpu: float  # weights + grads + optimizer state of the distributed GEMMs per rank

    @property
    def total_volume_bytes(self) -> float:
        return sum(self.volume_bytes.values())


def reduce_scatter_kind(island: IslandSpec) -> str:
    """How the island's collective library runs a reduce-scatter: ``"rs"`` (ring) or ``"ar"`` (gloo:
    an all-reduce of the whole buffer, then a local copy of this rank's chunk)."""
    return "ar" if island.device.collective_library == GLOO else "rs"


def _ring_bytes(kind: str, nbytes: float, n: int) -> float:
    if n == 1:
        return 0.0
    factor = 2 * (n - 1) / n if kind == "ar" else (n - 1) / n
    return factor * nbytes


def grid_cost(model: ModelSpec, island: IslandSpec, grid: Grid4D, *, batch_tokens: int,
              bytes_per_element: int = 2, chunks: int = 4, links: CollectiveLinks | None = None) -> GridCost:
    """Communication and GEMM time per iteration of ``model`` on ``grid`` inside ``island``.

    ``batch_tokens``: tokens of the global batch (global batch size * sequence length); each data
    replica processes ``batch_tokens / grid.data``. ``links``: a host profile's per-collective links
    for the intra-node axes (None: the island's intra-node link for every collective).
    """
    if batch_tokens % (grid.data * grid.z):
        raise ValueError(f"batch_tokens: {batch_tokens} must be a multiple of data*z = {grid.data}*{grid.z} = "
                         f"{grid.data * grid.z}. Fix: change the batch or the grid")
    if grid.size > island.num_gpus:
        raise ValueError(f"grid: {grid.size} ranks exceed the island's {island.num_gpus} GPUs "
                         f"(limit {island.num_gpus}). Fix: choose a smaller grid")
    m = batch_tokens // grid.data
    ch = {a: axis_channel(grid, a, island) for a in AXES}
    gemms = {g.name: g for g in layer_gemms(model, micro_batch_size=1, seq_length=model.seq_length)}
    vol = dict.fromkeys(("ag_weight", "ar_forward", "ar_backward", "rs_wgrad", "ar_data"), 0.0)
    t = dict(vol)
    compute = forward = hidden_oar = chunked_fwd = chunked_bwd = 0.0
    params = 0.0
    B = bytes_per_element
    for name, transposed in AXONN_GEMMS.items():
        g = gemms[name]
        a_in, a_out = ("y", "x") if transposed else ("x", "y")
        g_in, g_out = getattr(grid, a_in), getattr(grid, a_out)
        for what, size in (("k", g.k), ("n", g.n)):
            div = g_in if what == "k" else g_out * grid.z
            if size % div:
                raise ValueError(f"grid: {name} GEMM's {what}={size} is not a multiple of {div}. "
                                 f"Fix: choose a grid whose axes divide the layer's dimensions")
        w_block = B * g.n * g.k / (grid.x * grid.y)
        items = {
            "ag_weight": ("ag", w_block, "z"),
            "ar_forward": ("ar", B * m * g.n / (grid.z * g_out), a_in),
            "ar_backward": ("ar", B * m * g.k / (grid.z * g_in), a_out),
            "rs_wgrad": (reduce_scatter_kind(island), w_block, "z"),
            "ar_data": ("ar", w_block / grid.z, "data"),
        }
        per_gemm = {}
        per_chunked = {}
        for key, (kind, nbytes, axis) in items.items():
            n = getattr(grid, axis)
            fn = {"ag": ring_all_gather_time, "ar": ring_all_reduce_time, "rs": ring_reduce_scatter_time}[kind]
            c = ch[axis]
            if links is not None and _intra_node(grid, axis, island):
                c = links.for_item(key, ranks=n)
            per_gemm[key] = model.num_layers * fn(nbytes, n=n, bandwidth_gbps=c.bandwidth_gbps,
                                                  latency_us=c.latency_us)
            # cut into `chunks` collectives: the same bytes, `chunks` times the latency steps
            per_chunked[key] = model.num_layers * chunks * fn(nbytes / chunks, n=n, bandwidth_gbps=c.bandwidth_gbps,
                                                              latency_us=c.latency_us)
            vol[key] += model.num_layers * _ring_bytes(kind, nbytes, n)
            t[key] += per_gemm[key]
        local = Gemm(name=name, m=m // grid.z, n=g.n // g_out, k=g.k // g_in)
        f = model.num_layers * gemm_time(local, island.device)
        forward += f
        compute += 3 * f  # forward, input-gradient and weight-gradient GEMMs cost the same
        hidden_oar += min(per_gemm["ar_backward"], f)  # hidden behind this GEMM's weight gradient
        chunked_fwd += chunked_overlap_time(per_chunked["ag_weight"] + per_chunked["ar_forward"], f, chunks) - f
        bwd_comm = per_chunked["ar_backward"] + per_chunked["rs_wgrad"] + per_gemm["ar_data"]
        chunked_bwd += chunked_overlap_time(bwd_comm, 2 * f, chunks) - 2 * f
        params += model.num_layers * g.n * g.k / grid.tensor_parallel
    exposed = sum(t.values())
    backward = compute - forward
    overlapped = (t["ar_forward"] + (t["ar_backward"] - hidden_oar) + max(0.0, t["ag_weight"] - forward)
                  + max(0.0, t["rs_wgrad"] + t["ar_data"] - backward))
    overlapped_forward = t["ar_forward"] + max(0.0, t["ag_weight"] - forward)
    return GridCost(grid=grid, volume_bytes=vol, comm_s=t, compute_s=compute, exposed_s=exposed,
                    exposed_overlap_s=overlapped, exposed_forward_s=t["ag_weight"] + t["ar_forward"],
                    exposed_overlap_forward_s=overlapped_forward,
                    exposed_chunked_s=chunked_fwd + chunked_bwd, exposed_chunked_forward_s=chunked_fwd,
                    state_bytes_per_gpu=params * (PARAM_BYTES + GRAD_BYTES + OPTIMIZER_BYTES))


def _factorisations(n: int) -> list[tuple[int, int, int, int]]:
    divs = [d for d in range(1, n + 1) if n % d == 0]
    return [(a, b, c, n // (a * b * c)) for a, b, c in itertools.product(divs, repeat=3)
            if n % (a * b * c) == 0]


def candidate_grids(model: ModelSpec, island: IslandSpec, gpus: int, *, batch_tokens: int,
                    memory_fraction: float = 0.5, bytes_per_element: int = 2) -> list[GridCost]:
    """Every grid of ``gpus`` ranks that divides the model's GEMMs and the batch and whose
    weight/gradient/optimizer state fits in ``memory_fraction`` of a GPU (the rest is left for
    activations and the embedding, not modelled here), with its cost."""
    if gpus < 1 or gpus > island.num_gpus:
        raise ValueError(f"gpus: must be in [1, {island.num_gpus}], got {gpus} (limit {island.num_gpus}). "
                         f"Fix: ask for at most the island's GPUs")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction: must be in (0, 1], got {memory_fraction} (limit 1). "
                         f"Fix: pass e.g. 0.5")
    budget = memory_fraction * device_capacity_bytes(island.device)
    out = []
    for gx, gy, gz, gd in _factorisations(gpus):
        grid = Grid4D(x=gx, y=gy, z=gz, data=gd)
        try:
            cost = grid_cost(model, island, grid, batch_tokens=batch_tokens, bytes_per_element=bytes_per_element)
        except ValueError:
            continue  # the grid does not divide the model or the batch
        if cost.state_bytes_per_gpu <= budget:
            out.append(cost)
    return out


def best_grid(model: ModelSpec, island: IslandSpec, gpus: int, *, batch_tokens: int, overlap: bool = True,
              memory_fraction: float = 0.5, bytes_per_element: int = 2) -> GridCost:
    """The grid with the least exposed communication (ties: less volume, then smaller x*y*z)."""
    cands = candidate_grids(model, island, gpus, batch_tokens=batch_tokens, memory_fraction=memory_fraction,
                            bytes_per_element=bytes_per_element)
    if not cands:
        raise ValueError(f"gpus: no grid of {gpus} ranks fits the model's state in {memory_fraction} of "
                         f"{island.device.memory_gib} GiB and divides its GEMMs. Fix: use more GPUs or a larger "
                         f"memory_fraction")

    def key(c: GridCost):
        return (c.exposed_overlap_s if overlap else c.exposed_s, c.total_volume_bytes, c.grid.tensor_parallel)

    return min(cands, key=key)
