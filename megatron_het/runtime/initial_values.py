"""Plan-independent initial values: one seed gives one full model, whatever the plan.

Every parameter of the full model (global names, ``checkpoint/full_state.py``) is defined tile by
tile: a tile of a fixed shape is drawn on the host from a generator seeded by the run's seed, the
parameter's name and the tile's index, with the initialisation megatron-core's TransformerConfig of
the *whole* model prescribes (``init_method``, ``output_layer_init_method`` scaled by the model's
total layer count, ``embedding_init_method``; norms at one, biases at zero). A rank draws only the
tiles its piece overlaps (``SeededFullState.local``: a TP shard, a gated pair of halves, a 3D
block), so shards of any plan (TP/PP/DP, uneven layers, mixed TP, sharded plans, 3D TP,
interleaved chunks) are slices of one model and every holder of a parameter starts with the same
value: no start-up synchronisation is needed, and none can miss a holder.

Why tiles of a fixed shape: a value then depends on its position only, never on the tensor's extent,
so the rows of a padded vocabulary that the tokenizer uses are the same whatever padding a plan's TP
sizes ask for; and a rank of a large model draws its shard, not every full tensor it holds a piece of
(tiles run on a thread pool). Why on the host: NVIDIA and AMD islands get identical values (their
device generators are not promised to agree), as with Megatron-LM's ``--use-cpu-initialization``.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from megatron_het.checkpoint.full_state import TIED_OUTPUT, WORD_EMBEDDING
from megatron_het.cluster import ModelSpec
from megatron_het.platform import HOST_DEVICE
from megatron_het.runtime.grad_sync import Holding, held_indices

__all__ = ["SeededFullState", "init_kind", "load_seeded", "param_seed", "tile_shape"]

TILE = 1024  # a tile's extent along a dim (the dim's own size where shorter)
VOCAB_TILE_ROWS = 128  # along the (padded) vocabulary: fixed, so padding never changes a tile
VOCAB_ROWS = (WORD_EMBEDDING, TIED_OUTPUT)  # parameters with the vocabulary along dim 0


def init_kind(name: str) -> str:
    """How megatron-core initialises the full parameter ``name`` (a global name): ``zeros`` (every
    bias), ``ones`` (norm weights; zero with a zero-centred gamma), ``embedding`` (word and position
    embeddings: ``embedding_init_method``), ``output`` (the projections back into the residual
    stream, ``linear_proj`` and ``linear_fc2``: ``output_layer_init_method``), ``weight`` (the
    other linears, an MoE router and an untied output layer: ``init_method``). A name none of these covers is
    refused: a new parameter kind needs its rule here, never a silent guess."""
    if name.endswith(".bias"):
        return "zeros"
    if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
        return "ones"
    if name.startswith("embedding.") and name.endswith("_embeddings.weight"):
        return "embedding"
    if name.endswith((".linear_proj.weight", ".linear_fc2.weight")):
        return "output"
    # an MoE layer's router is drawn with init_method too (megatron-core transformer/moe/router.py:77)
    if name.endswith((".linear_qkv.weight", ".linear_fc1.weight", ".mlp.router.weight")) or name == TIED_OUTPUT:
        return "weight"
    raise ValueError(f"{name}: no plan-independent initialisation rule for this parameter. Fix: add its "
                     "megatron-core init method to runtime/initial_values.init_kind")


def param_seed(seed: int, key: str) -> int:
    """The generator seed of one tile (``key``: global name and tile index): a hash of the run's seed
    and the key, the same in every process (Python's ``hash`` is salted per process)."""
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def tile_shape(name: str, full_shape: Sequence[int]) -> tuple[int, ...]:
    """The tile of parameter ``name``: ``TILE`` (or the dim's size, where shorter) along each dim,
    ``VOCAB_TILE_ROWS`` along a vocabulary dim. A tile is always drawn whole, then cropped."""
    return tuple(VOCAB_TILE_ROWS if d == 0 and name in VOCAB_ROWS else min(n, TILE) for d, n in enumerate(full_shape))


class SeededFullState(Mapping[str, torch.Tensor]):
    """The whole model's initial values of one seed: ``local(holding)`` draws a rank's piece;
    as a Mapping, the full tensors by global name (fp32, host; drawn when asked for).

    ``padded_vocab``: the vocabulary the stages are built with (only the full shapes depend on it)."""

    def __init__(self, model: ModelSpec, *, seed: int, padded_vocab: int) -> None:
        from megatron_het.model.gpt import StageModelSpec, transformer_config
        from megatron_het.runtime.holdings import _build_meta, global_params

        self.model, self.seed = model, seed
        full = StageModelSpec(model=model, num_layers=model.num_layers, layer_offset=0, tp=1, pre_process=True,
                              post_process=True, vocab_size=padded_vocab)
        self.config = transformer_config(full)
        chunks = _build_meta([full], tp_rank=0, grid=None, micro_batch_size=1)
        tied = not model.untie_embeddings_and_output_weights
        self.shapes = {n: tuple(p.shape) for n, p in global_params([(chunks[0], 0)], tied=tied).items()}
        for name in self.shapes:
            init_kind(name)  # every parameter has a rule before any rank draws one

    def __len__(self) -> int:
        return len(self.shapes)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        return self.local(Holding(name=name, rank=0, stage_key=(0, 0), tp_rank=0, tp_size=1, partition_dim=None,
                                  full_shape=self.shapes[name]))

    def local(self, h: Holding) -> torch.Tensor:
        """The piece of parameter ``h.name`` that holding ``h`` describes (fp32, host), drawing only
        the tiles it overlaps."""
        if tuple(h.full_shape) != self.shapes.get(h.name):
            raise ValueError(f"{h.name}: the stage holds a piece of a {list(h.full_shape)} tensor, the model's is "
                             f"{list(self.shapes[h.name]) if h.name in self.shapes else 'absent'}. Fix: build the "
                             "stage and the initial values from the same model and padded vocabulary")
        indices = held_indices(h)
        out = torch.empty([len(i) for i in indices], device=HOST_DEVICE)
        kind = init_kind(h.name)
        if kind == "zeros" or (kind == "ones" and self.config.layernorm_zero_centered_gamma):
            return out.zero_()
        if kind == "ones":
            return out.fill_(1.0)
        method = {"embedding": self.config.embedding_init_method, "output": self.config.output_layer_init_method,
                  "weight": self.config.init_method}[kind]
        tile = tile_shape(h.name, h.full_shape)
        # per dim: (tile index, local positions [a, b), offsets inside the tile) of every tile it overlaps
        per_dim = []
        for idx, t in zip(indices, tile):
            spans = []
            for k in range(int(idx[0]) // t, int(idx[-1]) // t + 1):
                inside = torch.nonzero((idx >= k * t) & (idx < (k + 1) * t)).reshape(-1)
                if inside.numel():  # idx is increasing: the positions inside one tile are consecutive
                    spans.append((k, int(inside[0]), int(inside[-1]) + 1, idx[inside] - k * t))
            per_dim.append(spans)

        def draw(job) -> None:
            values = torch.empty(tile, device=HOST_DEVICE)
            g = torch.Generator().manual_seed(param_seed(self.seed, f"{h.name}#{','.join(str(s[0]) for s in job)}"))
            method(values, generator=g)
            for d, span in enumerate(job):
                values = values.index_select(d, span[3])
            out[tuple(slice(a, b) for _, a, b, _ in job)] = values

        jobs = list(itertools.product(*per_dim))
        if len(jobs) == 1:
            draw(jobs[0])
        else:
            with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
                list(pool.map(draw, jobs))
        return out


@torch.no_grad()
def load_seeded(params: Mapping[str, torch.Tensor], holdings: Sequence[Holding], init: SeededFullState) -> None:
    """Every parameter (by global name) takes its piece of the seeded model; ``holdings`` describe the
    pieces (``runtime/holdings.stage_holdings``: TP shards, gated halves, 3D blocks)."""
    for h in holdings:
        params[h.name].copy_(init.local(h).to(params[h.name].dtype))
