"""The distributed optimizer takes its flat shard from one parameter's canonical copy at a time.

``_my_pieces`` builds each local tensor's canonical fp32 form (a copy for bf16 values and for GLU or
partition_dim > 0 layouts) to cut this rank's pieces from it. Kept until the end, those copies were a
transient fp32 copy of the whole stage at every call (initialisation, checkpoint load, each step of
the overlapped path's reduce); each is now dropped after its last piece. Checked on a stub with the
optimizer's layout attributes: the shard's values, and how many copies are alive at once."""

import weakref
from types import SimpleNamespace

import torch

from megatron_het.optim.distributed import DistributedOptimizer


def _stub(pieces: dict[int, list[tuple[str, int, int]]], blocks: dict[str, tuple[int, int]], live: list):
    start, pos = {}, 0
    for i, ps in pieces.items():
        start[i] = pos
        pos += sum(b - a for _, a, b in ps)

    def canonical(name: str, t: torch.Tensor) -> torch.Tensor:
        out = t.reshape(-1).clone()  # a copy, as for a GLU or partition_dim > 0 layout
        live.append(weakref.ref(out))
        return out

    stub = SimpleNamespace(shard_numel=pos, device=torch.device("cpu"), _mine=list(pieces), _start=start,
                           _pieces={i: [SimpleNamespace(name=n, start=a, stop=b) for n, a, b in ps]
                                    for i, ps in pieces.items()},
                           _block=lambda name: blocks[name], _canonical=canonical)
    stub._take_pieces = lambda out, source, names=None: DistributedOptimizer._take_pieces(stub, out, source, names)
    return stub


def _values(blocks):
    return {n: torch.arange(lo, hi, dtype=torch.float32) for n, (lo, hi) in blocks.items()}


def test_one_canonical_copy_alive_at_a_time():
    blocks = {"a": (0, 6), "b": (6, 10), "c": (10, 16)}  # this rank's full blocks (global element ranges)
    pieces = {0: [("a", 2, 6), ("b", 6, 8)], 1: [("c", 10, 13)]}
    values, live, alive_at_source = _values(blocks), [], []

    def source(name):
        alive_at_source.append(sum(r() is not None for r in live))
        return values[name]

    out = DistributedOptimizer._my_pieces(_stub(pieces, blocks, live), source)
    assert out.dtype == torch.float32
    assert out.tolist() == [2, 3, 4, 5, 6, 7, 10, 11, 12]
    assert alive_at_source == [0, 0, 0]  # before: [0, 1, 2] (every copy kept to the end)
    assert all(r() is None for r in live)


def test_a_parameter_split_across_buckets_is_kept_until_its_last_piece():
    blocks = {"a": (0, 8), "b": (8, 12)}
    pieces = {0: [("a", 0, 3), ("b", 8, 10)], 1: [("a", 5, 8)]}
    values, live, sources = _values(blocks), [], []

    def source(name):
        sources.append(name)
        return values[name]

    out = DistributedOptimizer._my_pieces(_stub(pieces, blocks, live), source)
    assert out.tolist() == [0, 1, 2, 8, 9, 5, 6, 7]
    assert sources == ["a", "b"]  # "a" is read once, not rebuilt for its second bucket


def test_a_group_of_names_writes_only_its_pieces_at_their_offsets():
    """A streamed load (dist_ckpt.load_in_groups) hands one group of parameters at a time: only their
    pieces are written, each at its place in the shard; the others keep what they held."""
    blocks = {"a": (0, 6), "b": (6, 10), "c": (10, 16)}
    pieces = {0: [("a", 2, 6), ("b", 6, 8)], 1: [("c", 10, 13)]}
    values, live = _values(blocks), []
    stub = _stub(pieces, blocks, live)
    out = torch.full((stub.shard_numel,), -1.0)
    DistributedOptimizer._take_pieces(stub, out, lambda n: values[n], {"b", "c"})
    assert out.tolist() == [-1, -1, -1, -1, 6, 7, 10, 11, 12]
    DistributedOptimizer._take_pieces(stub, out, lambda n: values[n], {"a"})
    assert out.tolist() == [2, 3, 4, 5, 6, 7, 10, 11, 12]
