"""The pipeline runtime's distributed optimizer (``--use-distributed-optimizer``).

megatron-core's ``DistributedOptimizer`` is not used: it shards one flat gradient buffer laid out
identically on every DP rank, which replicas with different TP sizes (or stages of different
layer ranges) do not have. Here (layout: ``optim/holders.py``) each full parameter's fp32 main
values and Adam moments are split among all its holders, each owning a slice of what it holds,
uneven in proportion to free memory; the arithmetic is the sharded strategy's ``ShardedAdamW``
(one implementation for both modes).

Per iteration, for every bucket (one group of holders):

1. reduce-scatter: each member writes its fp32 gradient block (a replicated parameter once per
   stage, all TP ranks for a sequence-parallel one) straight into one zero buffer of the bucket,
   laid out so each owner's pieces are contiguous, and calls the comm layer's uneven
   reduce-scatter (``comm/uneven.py``: gloo has none), getting the summed gradient of its pieces;
   buckets close at ``--ddp-bucket-size`` elements, so that buffer is one bucket's, not a stage's;
2. norm and clipping on the pieces (every element is owned once, so the squared norm is the sum
   of the owners' pieces over the world);
3. AdamW on the pieces (``ShardedAdamW``); fp32 main values are kept as pieces in mixed precision
   only (in fp32 the model parameters are the main values, taken for the step and dropped, as
   Megatron's fp32 distributed optimizer keeps ``8 + 8/d`` bytes per parameter);
4. all-gather: the owners' updated values are gathered (uneven all-gather) in the parameters' dtype
   (bf16 in mixed precision, as megatron-core gathers its bf16 parameter buffer) and every holder
   writes its block into its model parameter.

The object plays the parts of both the runtime's gradient synchronizer and its torch optimizer
(``reduce``, ``grad_norm_sq_local``, ``scale_grads``, ``owned``, ``local``;
``param_groups``, ``zero_grad``, ``step``), so the strategy's iteration is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_het.comm.uneven import uneven_all_gather, uneven_all_gather_start, uneven_reduce_scatter
from megatron_het.optim.adamw import Run, ShardedAdamW, decays
from megatron_het.optim.holders import ShardBucket, block, canonical_flat, plan_shard_buckets, write_canonical
from megatron_het.optim.layout import ShardLayout
from megatron_het.optim.norms import sum_of_squares_f64
from megatron_het.platform import HOST_DEVICE
from megatron_het.train.lr_schedule import is_decoupled

__all__ = ["DistributedOptimizer"]


def _bridge_method(het, leaders: str) -> str:
    """The construction of a reduce-scatter / all-gather over a bridged group: the bridge's sharded
    all-reduce of the whole buffer where its all-reduce is sharded (every island has >= 2 ranks:
    each holder then sends 2(k-1)/k of 1/S of the buffer across, no more than one leader's
    (k-1)/k of all of it), else ``leaders`` (its leader-based collective). perf.comm prices the
    same choice (``distributed_optimizer_share``)."""
    return "all_reduce" if het.topology.shards > 1 else leaders


class DistributedOptimizer:
    """Sharded fp32 main values + Adam moments over each parameter's holders (construct on every rank)."""

    def __init__(self, local: Sequence, params: Mapping[str, torch.nn.Parameter], *, train,
                 new_group: Callable[[tuple[int, ...]], object | None], owned: Callable[[list], set] | None = None,
                 main_grads: Mapping[str, torch.Tensor] | None = None, weights: Mapping[int, float] | None = None,
                 device: torch.device, overlap_param_gather_in: torch.nn.Module | None = None,
                 gather_method: str = "padded", reduce_scatter_method: str = "native", reducer=None,
                 bucket_numel: int | None = None) -> None:
        """``local``: this rank's holdings (``runtime.grad_sync.Holding``); ``params``: the model's
        parameters by global name; ``new_group(ranks)``: creates a group over ``ranks`` (collective
        over the world, None on non-members; runtime.comm_routing routes it natively or through the
        bridge); ``owned(all_holdings)``: the (name, rank) pairs that count once (in the global norms);
        ``main_grads``: fp32 gradient buffers in mixed precision (None: the
        parameters' own ``.grad``); ``weights``: rank -> free memory (None: equal shares);
        ``overlap_param_gather_in``: the stage's module: ``step()`` then only starts each bucket's
        all-gather, and a forward pre-hook on every sub-module that owns parameters finishes the
        buckets of its parameters just before it runs (Megatron's ``--overlap-param-gather``);
        ``gather_method`` / ``reduce_scatter_method``: the comm layer's constructions on torch groups
        (``comm/uneven.py``); ``reducer``: a gradient synchronizer over the same gradients
        (``runtime/overlap_grad.OverlappedGradientSynchronizer``, ``--overlap-grad-reduce``) that
        all-reduces them in buckets during the last backward; ``reduce()`` then takes this rank's
        pieces of the summed gradients instead of reduce-scattering after the backward;
        ``bucket_numel``: a bucket closes once it carries that many elements (``--ddp-bucket-size``; None:
        one bucket per group of holders). The collectives' buffers are one bucket's, so this bounds
        the temporary memory of a reduce and of a gather."""
        self._methods = {"gather": gather_method, "reduce_scatter": reduce_scatter_method}
        # --overlap-grad-reduce: gradients all-reduced in buckets as the last backward produces them (an
        # all-reduce, not megatron-core's bucketed reduce-scatter: the runtime's overlapped buckets are
        # all-reduce buckets, and twice the traffic hidden behind the backward beats half of it after)
        self.reducer = reducer
        self.arm = reducer.arm if reducer is not None else None  # the executor arms the last backward
        self.device, self.train = device, train
        self.rank = dist.get_rank()
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, list(local))
        self.all_holdings = [h for hs in gathered for h in hs]
        self.local = {h.name: h for h in local}
        self.params = dict(params)
        self.main_grads = dict(main_grads) if main_grads is not None else None
        self.buckets: list[ShardBucket] = plan_shard_buckets(self.all_holdings, weights=weights, bucket_numel=bucket_numel)
        self.owned = owned(self.all_holdings) if owned is not None else set()
        self._groups: list = []
        self.routes: list[tuple[tuple[int, ...], str]] = []
        for b in self.buckets:  # every rank creates every multi-rank group, in the same order
            g = new_group(b.ranks) if len(b.ranks) > 1 else None
            self._groups.append(g)
            if g is not None:
                self.routes.append((b.ranks, g.kind))
        self._mine = [i for i, b in enumerate(self.buckets) if self.rank in b.ranks]
        # per bucket: where this rank's blocks sit in the owner-ordered buffer of the collectives
        self._segments = {i: self.buckets[i].local_segments({n: self._block(n) for n in self.local})
                          for i in self._mine}
        # the dtype the updated values are gathered in: the parameters' (bf16 in mixed precision: half
        # the bytes of fp32, and the same values, since every holder casts to it anyway), as megatron-core
        # all-gathers its bf16 parameter buffer
        self._gather_dtype = {i: self._common_dtype(self.buckets[i].names) for i in self._mine}
        # this rank's pieces, in (bucket, owner order) order: the layout of its flat shard
        self._pieces = {i: self.buckets[i].pieces_of(self.rank) for i in self._mine}
        self._start = {}  # bucket index -> offset of its pieces in the flat shard
        self._span = {}  # bucket index -> its pieces' slice of the flat shard
        pos = 0
        for i in self._mine:
            self._start[i] = pos
            pos += sum(p.stop - p.start for p in self._pieces[i])
            self._span[i] = slice(self._start[i], pos)
        self.shard_numel = pos
        runs = []  # Megatron's groups over the flat shard: decay, and --decoupled-lr on the embedding/output
        for i in self._mine:
            at = self._start[i]
            for p in self._pieces[i]:
                runs.append(Run(start=at, stop=at + p.stop - p.start,
                                decays=decays(p.name, tuple(self.local[p.name].full_shape)),
                                decoupled=train.decoupled_lr is not None and is_decoupled(p.name)))
                at += p.stop - p.start
        self.adam = ShardedAdamW(master=self._my_pieces(lambda n: self.params[n].detach()), runs=runs, train=train)
        # fp32: the model parameters are the main values (as in Megatron's fp32 distributed optimizer),
        # so the fp32 pieces exist only during a step; mixed precision keeps them (the only fp32 copy)
        self.keeps_master = self.main_grads is not None
        if not self.keeps_master:
            self.adam.master = self._empty()
        self.shard_grad = self._empty()  # reduced gradient pieces, from reduce() to step()
        # the strategy sets the learning rates here each step (decoupled_lr: --decoupled-lr's, or None)
        self.param_groups = [{"lr": train.lr, "decoupled_lr": None}]
        self._pending: dict[int, object] = {}  # bucket index -> gather in flight (overlap_param_gather)
        self._hooks = []
        if overlap_param_gather_in is not None:
            by_param = {id(self.params[n]): [i for i in self._mine if n in self.buckets[i].names] for n in self.local}
            for module in overlap_param_gather_in.modules():
                owned_here = sorted({i for p in module.parameters(recurse=False) for i in by_param.get(id(p), ())})
                if owned_here:
                    self._hooks.append(module.register_forward_pre_hook(self._finish_hook(owned_here)))
        self.overlap_param_gather = overlap_param_gather_in is not None

    # ---- layout helpers -----------------------------------------------------------------------
    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.float32, device=self.device)

    def _master(self) -> torch.Tensor:
        """The fp32 pieces of the main values (fp32: taken from the parameters for this step)."""
        if not self.keeps_master:
            self.adam.master = self._my_pieces(lambda n: self.params[n].detach())
        return self.adam.master

    def _release_master(self) -> None:
        if not self.keeps_master:
            self.adam.master = self._empty()

    def _block(self, name: str) -> tuple[int, int]:
        h = self.local[name]
        return block(h, int(torch.Size(h.full_shape).numel()))

    def _canonical(self, name: str, t: torch.Tensor) -> torch.Tensor:
        h = self.local[name]
        return canonical_flat(t, h.partition_dim, h.glu)

    def _my_pieces(self, source: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """This rank's flat shard taken from local full-block tensors ``source(name)`` (fp32)."""
        out = torch.empty(self.shard_numel, dtype=torch.float32, device=self.device)
        self._take_pieces(out, source)
        return out

    def _take_pieces(self, out: torch.Tensor, source: Callable[[str], torch.Tensor],
                     names: Container[str] | None = None) -> None:
        """Write into this rank's flat shard ``out`` its pieces of the parameters ``names`` (None: all),
        taken from local full-block tensors ``source(name)``.

        A tensor's canonical fp32 form (a copy for bf16 values, GLU or partition_dim > 0 layouts) is
        kept only until its last piece is taken: one parameter's copy at a time, not the whole stage's."""
        order = [(i, p) for i in self._mine for p in self._pieces[i]]
        last = {p.name: k for k, (_, p) in enumerate(order)}
        cache: dict[str, torch.Tensor] = {}
        at = dict(self._start)
        for k, (i, p) in enumerate(order):
            n = p.stop - p.start
            if names is None or p.name in names:
                if p.name not in cache:
                    cache[p.name] = self._canonical(p.name, source(p.name)).float()
                lo = self._block(p.name)[0]
                out[at[i]:at[i] + n] = cache[p.name][p.start - lo:p.stop - lo]
                if last[p.name] == k:
                    del cache[p.name]
            at[i] += n

    def _grad(self, name: str) -> torch.Tensor:
        if self.main_grads is not None:
            return self.main_grads[name]
        p = self.params[name]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    def _contributes(self, name: str) -> bool:
        h = self.local[name]
        return h.partition_dim is not None or h.tp_rank == 0 or h.sequence_parallel

    # ---- collectives --------------------------------------------------------------------------
    def _common_dtype(self, names) -> torch.dtype:
        dtypes = {self.params[n].dtype for n in names if n in self.local}
        return dtypes.pop() if len(dtypes) == 1 else torch.float32

    def _reduce_scatter(self, source: Callable[[str], torch.Tensor | None]) -> torch.Tensor:
        """Summed ``source`` over holders, for this rank's pieces (flat, shard layout). Per bucket one
        buffer, written straight in owner order (zeros where this rank holds nothing or does not
        contribute), one parameter's canonical copy at a time."""
        out = torch.empty(self.shard_numel, dtype=torch.float32, device=self.device)
        for i in self._mine:
            b, group = self.buckets[i], self._groups[i]
            inp = torch.zeros(b.numel, dtype=torch.float32, device=self.device)
            for name, segments in self._segments[i].items():
                t = source(name)
                if t is None:
                    continue
                flat = self._canonical(name, t)
                for pos, off, n in segments:
                    inp[pos:pos + n] = flat[off:off + n]
                del flat
            if group is None:
                mine = inp
            else:
                kw = ({"bridge": group.het, "method": _bridge_method(group.het, "reduce")} if group.kind != "native"
                      else {"group": group.group, "method": self._methods["reduce_scatter"]})
                mine = uneven_reduce_scatter(inp, ShardLayout(sizes=b.sizes()), **kw)
            del inp
            out[self._span[i]] = mine
        return out

    def _all_gather_into(self, shard: torch.Tensor, sink: Callable[[str, torch.Tensor], None], *,
                         dtype: torch.dtype | None = None, names: set[str] | None = None) -> None:
        """Every owner's ``shard`` pieces gathered in ``dtype`` (None: the parameters'); ``sink(name,
        canonical block)`` per local parameter (of ``names`` only, when given)."""
        for i in self._mine:
            b, group = self.buckets[i], self._groups[i]
            piece = shard[self._span[i]].to(dtype or self._gather_dtype[i])
            if group is None:
                gathered = piece
            else:
                kw = ({"bridge": group.het, "method": _bridge_method(group.het, "padded")} if group.kind != "native"
                      else {"group": group.group, "method": self._methods["gather"]})
                gathered = uneven_all_gather(piece.contiguous(), ShardLayout(sizes=b.sizes()), **kw)
            del piece
            self._scatter_gathered(i, gathered, sink, names)

    def _finish_hook(self, buckets: list[int]):
        def hook(_module, _args) -> None:
            for i in buckets:
                self._finish(i)
        return hook

    @torch.no_grad()
    def _finish(self, i: int) -> None:
        """Wait for bucket ``i``'s gather (if in flight) and write its parameters."""
        pending = self._pending.pop(i, None)
        if pending is None:
            return
        self._scatter_gathered(i, pending.wait(), self._write_params)

    def finish_param_gather(self) -> None:
        """Complete every gather still in flight (before reading parameters outside a forward)."""
        for i in list(self._pending):
            self._finish(i)

    def _start_gathers(self, shard: torch.Tensor) -> None:
        for i in self._mine:
            b, group = self.buckets[i], self._groups[i]
            piece = shard[self._span[i]].to(self._gather_dtype[i], copy=True)
            if group is None:
                self._scatter_gathered(i, piece, self._write_params)
                continue
            kw = ({"bridge": group.het, "bridge_method": _bridge_method(group.het, "padded")}
                  if group.kind != "native" else {"group": group.group})
            self._pending[i] = uneven_all_gather_start(piece, ShardLayout(sizes=b.sizes()), **kw)

    def _scatter_gathered(self, i: int, gathered: torch.Tensor, sink: Callable[[str, torch.Tensor], None],
                          names: set[str] | None = None) -> None:
        """``sink(name, block)`` for each of this rank's parameters in bucket ``i`` (of ``names`` only,
        when given), its canonical block read from the owner-ordered ``gathered`` (one parameter's
        block at a time)."""
        for name, segments in self._segments[i].items():
            if names is not None and name not in names:
                continue
            bs, be = self._block(name)
            flat = torch.empty(be - bs, dtype=gathered.dtype, device=self.device)
            for pos, off, n in segments:
                flat[off:off + n] = gathered[pos:pos + n]
            sink(name, flat)

    def _write_params(self, name: str, flat: torch.Tensor) -> None:
        h = self.local[name]
        write_canonical(self.params[name].data, flat, h.partition_dim, h.glu)

    # ---- synchronizer interface -----------------------------------------------------------------
    def reduce(self) -> None:
        """Reduce-scatter every gradient over its holders into this rank's pieces (with a reducer: wait
        for its overlapped all-reduces, then take this rank's pieces of the sums)."""
        self.finish_param_gather()  # a stage whose forward never touched a bucket (none today): finish here
        if self.reducer is not None:
            self.reducer.reduce()  # every holder's gradient is now the sum over the holders
            self.shard_grad = self._my_pieces(self._grad)
            return
        self.shard_grad = self._reduce_scatter(lambda n: self._grad(n) if self._contributes(n) else None)

    @property
    def launched_in_backward(self) -> int | None:
        """Buckets the reducer launched during the last armed backward (None: no reducer)."""
        return None if self.reducer is None else self.reducer.launched_in_backward

    def grad_norm_sq_local(self) -> torch.Tensor:
        """This rank's share of the squared global norm (each element is owned exactly once)."""
        return sum_of_squares_f64(self.shard_grad)

    def param_norm_sq_local(self) -> torch.Tensor:
        """This rank's share of the squared global parameter norm, after a step (--log-params-norm):
        its fp32 main pieces where it keeps them, else its pieces of the parameters."""
        if self.keeps_master and self.adam.master.numel():
            return sum_of_squares_f64(self.adam.master)
        self.finish_param_gather()  # --overlap-param-gather: the parameters hold the step's values only after it
        return sum_of_squares_f64(self._my_pieces(lambda n: self.params[n].detach()))

    def grad_zeros_local(self) -> torch.Tensor:
        """This rank's share of the global count of zero gradient elements (--log-num-zeros-in-grad)."""
        return (self.shard_grad == 0).sum().to(torch.float64)

    def scale_grads(self, coeff: float | torch.Tensor) -> None:
        """Clipping: scale the reduced gradient pieces."""
        self.shard_grad.mul_(coeff)

    # ---- optimizer interface ------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = False) -> None:
        for name in self.local:
            if self.main_grads is not None:
                self.main_grads[name].zero_()
            elif self.params[name].grad is not None:
                self.params[name].grad.zero_()

    @torch.no_grad()
    def step(self, *, compute: Callable[[Callable[[], object]], object] | None = None) -> None:
        """AdamW on this rank's pieces, then the updated values all-gathered into every holder's model.

        ``compute(fn)`` runs the local update (an emulated device's timer stretches it: EmulationTimer.stretch);
        the all-gather is communication, which a slower device does not slow, and runs outside it, with the
        copy of the gathered values into the model's parameters (a cast per element, unstretched here while
        the plain optimizer's ``copy_to_model`` is stretched: small beside the update, left so)."""
        self.finish_param_gather()
        lr, decoupled_lr = float(self.param_groups[0]["lr"]), self.param_groups[0].get("decoupled_lr")

        def update() -> None:
            self._master()
            self.adam.step(self.shard_grad, lr, decoupled_lr)

        (compute or (lambda fn: fn()))(update)
        if self.overlap_param_gather:  # finished by the next forward's pre-hooks, bucket by bucket
            self._start_gathers(self.adam.master)
        else:
            self._all_gather_into(self.adam.master, self._write_params)
        self._release_master()
        self.shard_grad = self._empty()  # the reduced pieces live from reduce() to here

    def state_dict(self):
        raise NotImplementedError("the distributed optimizer's state moves through checkpoints "
                                  "(save_checkpoint / load_checkpoint), not state_dict(); rebuilding groups "
                                  "after a failure needs a checkpoint reload with --use-distributed-optimizer")

    # ---- checkpoints: layout-independent local form --------------------------------------------
    @torch.no_grad()
    def local_state(self, only: set[str] | None = None
                    ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
        """fp32 main values and Adam moments as full local blocks (the parameters' shapes), on the
        host: the form the checkpoint writes, identical to what a run without the distributed
        optimizer holds. ``only``: the parameters wanted (the ones this rank writes; None: all); every
        rank still joins every bucket's gathers. The device holds one bucket's gather at a time."""
        self.finish_param_gather()
        wanted = set(self.local) if only is None else set(only) & set(self.local)
        values: dict[str, torch.Tensor] = {}
        moments: dict[str, dict[str, torch.Tensor]] = {n: {} for n in wanted}

        def into(target: dict, key: str | None):
            def sink(name: str, flat: torch.Tensor) -> None:
                h = self.local[name]
                t = torch.empty(self.params[name].shape, dtype=torch.float32, device=HOST_DEVICE)
                write_canonical(t, flat, h.partition_dim, h.glu)
                if key is None:
                    target[name] = t
                else:
                    target[name][key] = t
            return sink

        if self.keeps_master:
            self._all_gather_into(self.adam.master, into(values, None), dtype=torch.float32, names=wanted)
        else:  # fp32: every holder's parameters are the main values
            values = {n: self.params[n].detach().to(HOST_DEVICE, torch.float32, copy=True) for n in wanted}
        self._all_gather_into(self.adam.exp_avg, into(moments, "exp_avg"), dtype=torch.float32, names=wanted)
        self._all_gather_into(self.adam.exp_avg_sq, into(moments, "exp_avg_sq"), dtype=torch.float32, names=wanted)
        return values, moments

    @torch.no_grad()
    def load_local_state(self, values: Mapping[str, torch.Tensor],
                         moments: Mapping[str, Mapping[str, torch.Tensor]] | None, *, step: int) -> None:
        """Take this rank's pieces of local-form values (and moments) of the parameters in ``values``
        (all of this rank's, or one group of a streamed load: ``dist_ckpt.load_in_groups``) and write
        them into the model."""
        self.finish_param_gather()
        names = set(values)
        if self.keeps_master:
            self._take_pieces(self.adam.master, lambda n: values[n], names)
        if moments is not None:
            self._take_pieces(self.adam.exp_avg, lambda n: moments[n]["exp_avg"], names)
            self._take_pieces(self.adam.exp_avg_sq, lambda n: moments[n]["exp_avg_sq"], names)
            self.adam.step_count = int(step)
        for name in names & self.local.keys():
            self.params[name].data.copy_(values[name])

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank keeps between steps: two moments (+ fp32 main pieces in
        mixed precision)."""
        a = self.adam
        return sum(t.numel() * t.element_size() for t in (a.master, a.exp_avg, a.exp_avg_sq))
