"""Plan-independent initial values: one seed gives one full model, whatever the plan.

Every parameter of the full model (global names, ``checkpoint/full_state.py``) is drawn whole on
the host from a generator seeded by the run's seed and the parameter's name, with the
initialisation megatron-core's TransformerConfig of the *whole* model prescribes (``init_method``,
``output_layer_init_method`` scaled by the model's total layer count, ``embedding_init_method``;
norms at one, biases at zero). Each rank then takes its slice through the same loader that places a
checkpoint's full tensors (``load_full_state``), so shards of any plan (TP/PP/DP, uneven layers,
mixed TP, sharded plans, 3D TP, interleaved chunks) are slices of one model and every holder of a
parameter starts with the same value: no start-up synchronisation is needed, and none can miss a
holder. The rows of a padded vocabulary beyond the tokenizer's come from a seed of their own, so
the real rows do not depend on the padding a plan's TP sizes ask for.

Drawing on the host (not the device) keeps the values identical on NVIDIA and AMD islands (their
device generators are not promised to agree) and is what Megatron-LM's ``--use-cpu-initialization``
does; each rank draws only the full tensors it holds a piece of, one at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping

import torch

from megatron_het.checkpoint.full_state import TIED_OUTPUT, WORD_EMBEDDING
from megatron_het.cluster import ModelSpec

__all__ = ["SeededFullState", "init_kind", "param_seed"]

# Parameters with the vocabulary along dim 0 (padded for TP): their padding rows are drawn apart.
VOCAB_ROWS = (WORD_EMBEDDING, TIED_OUTPUT)


def init_kind(name: str) -> str:
    """How megatron-core initialises the full parameter ``name`` (a global name): ``zeros`` (every
    bias), ``ones`` (norm weights; zero with a zero-centred gamma), ``embedding`` (word and position
    embeddings: ``embedding_init_method``), ``output`` (the projections back into the residual
    stream, ``linear_proj`` and ``linear_fc2``: ``output_layer_init_method``), ``weight`` (the
    other linears and an untied output layer: ``init_method``). A name none of these covers is
    refused: a new parameter kind needs its rule here, never a silent guess."""
    if name.endswith(".bias"):
        return "zeros"
    if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
        return "ones"
    if name.startswith("embedding.") and name.endswith("_embeddings.weight"):
        return "embedding"
    if name.endswith((".linear_proj.weight", ".linear_fc2.weight")):
        return "output"
    if name.endswith((".linear_qkv.weight", ".linear_fc1.weight")) or name == TIED_OUTPUT:
        return "weight"
    raise ValueError(f"{name}: no plan-independent initialisation rule for this parameter. Fix: add its "
                     "megatron-core init method to runtime/initial_values.init_kind")


def param_seed(seed: int, name: str) -> int:
    """The generator seed of one full parameter: a hash of the run's seed and the global name (the
    same in every process; Python's ``hash`` is salted per process)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class SeededFullState(Mapping[str, torch.Tensor]):
    """The full model's initial tensors by global name, drawn when asked for (fp32, host).

    ``padded_vocab``: the vocabulary the stages are built with; ``model.vocab_size`` rows of the
    embedding (and untied output layer) are the model's, the rest padding."""

    def __init__(self, model: ModelSpec, *, seed: int, padded_vocab: int) -> None:
        from megatron_het.model.gpt import StageModelSpec, transformer_config
        from megatron_het.runtime.holdings import _build_meta, global_params

        self.model, self.seed = model, seed
        full = StageModelSpec(model=model, num_layers=model.num_layers, layer_offset=0, tp=1, pre_process=True,
                              post_process=True, vocab_size=padded_vocab)
        self.config = transformer_config(full)
        chunks, _ = _build_meta([full], tp_rank=0, grid=None, micro_batch_size=1)
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
        shape, kind = self.shapes[name], init_kind(name)
        if kind == "zeros" or (kind == "ones" and self.config.layernorm_zero_centered_gamma):
            return torch.zeros(shape)
        if kind == "ones":
            return torch.ones(shape)
        method = {"embedding": self.config.embedding_init_method, "output": self.config.output_layer_init_method,
                  "weight": self.config.init_method}[kind]
        rows = self.model.vocab_size if name in VOCAB_ROWS else shape[0]
        out = torch.empty(shape)
        self._draw(method, out[:rows], name)
        if rows < shape[0]:
            self._draw(method, out[rows:], f"{name}#padding")
        return out

    def _draw(self, method, out: torch.Tensor, key: str) -> None:
        """megatron-core's init ``method`` (it draws from the global host generator) under this
        parameter's own seed, leaving the caller's generator state as it was."""
        part = torch.empty(out.shape)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(param_seed(self.seed, key))
            method(part)
        out.copy_(part)
