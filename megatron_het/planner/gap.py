"""How far a plan can get toward an upper bound, read off the model's own stage costs (issue #19).

Two figures that need no search and hold for any plan of the planner's building blocks:

- :func:`fluid_tokens_per_s`: every GPU runs the whole model at its island's best per-GPU sequence
  rate (any TP size, micro-batch size, recompute the parallelizer offers), the batch is split
  continuously and nothing synchronises. No plan is faster; the distance from it is whole
  sequences (quantisation), pipeline fill, transfers, gradient reduction and the optimizer step.
- :func:`island_capacity`: the sequences one island completes within ``seconds`` with replicas
  kept on that island (TP x PP x micro-batch size x recompute; stages ideally balanced, no
  transfers, no gradient reduction, no optimizer step; fractional replicas allowed). An upper bound
  for that family: when the islands together fall short of the global batch at the time a target
  needs, no such plan (data parallelism across islands, whatever the reduction costs) meets it.

Both use the Estimator's rows, i.e. the parallelizer's costs and memory caps, so they move with the
performance model. Since the planner gives a recomputing stage the least block recomputation that
fits (planner/block_recompute.py: only each chunk's first N layers recompute), a family with
recompute holds up to the full-recompute row's memory cap of layers (full recomputation needs the
least memory) but its layers are priced at the non-recomputing row's time when that row exists
(a stage's layers cannot cost less); before, at the full-recompute time, which a plan recomputing
fewer layers could beat.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_het.planner.estimate import Estimator

__all__ = ["Family", "best_rate", "fluid_tokens_per_s", "island_capacity", "one_island_time"]

_PP = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80)  # pipeline depths tried inside one island
_MICRO_BATCH_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True, kw_only=True)
class Family:
    """Replicas of one layout on one island."""

    island: str  # island name
    tp: int  # tensor-parallel size of every stage
    pp: int  # stages per replica
    micro_batch_size: int  # sequences per micro-batch
    recompute: bool  # recomputation allowed (full-recompute memory cap, non-recomputing layer time)
    micro_batch_s: float  # one micro-batch through the whole model on one stage (forward + backward), seconds


def _families(est: Estimator, isl: int):
    """Every (family, whole-model seconds per micro-batch) whose stages fit in memory."""
    L = est.model.num_layers
    name = est.cluster.islands[isl].name
    for tp in est.tp_sizes(isl):
        for pp in _PP:
            if pp > L or tp * pp > est.cluster.islands[isl].num_gpus:
                continue
            for mbs in _MICRO_BATCH_SIZES:
                if est.global_batch_size % mbs:
                    continue
                # The most permissive memory any stage of such a plan sees, so that the bound stays
                # a bound: a middle stage (no embedding or output layer) with one micro-batch in
                # flight (1F1B's last stage), the optimizer state sharded over as many replicas as
                # the whole cluster could hold (distributed optimizer; cross-island DP shards wider).
                replicas = est.cluster.num_gpus // (tp * pp)
                rows = est.rows(isl, tp, mbs, True, pp == 1, pp == 1, 1, replicas)
                plain = rows[0]
                for rc, (fixed, per_layer, cap) in enumerate(rows):
                    if per_layer <= 0 or cap < -(-L // pp):
                        continue
                    # Block recomputation: a recomputing stage may recompute as few as one layer per
                    # chunk, so its layers are priced at the plain row's time when one layer fits
                    # without recompute (otherwise every layer must recompute), under this row's cap.
                    cheap = rc == 1 and plain[1] > 0
                    if cheap:
                        fixed, per_layer = plain[0], plain[1]
                    # Whole model on one stage: the embedding and output layer are in ``fixed``
                    # only when the row is first and last; a pipeline pays them once too.
                    whole = fixed + L * per_layer if pp == 1 else _whole(est, isl, tp, mbs, rc == 1 and not cheap)
                    yield Family(island=name, tp=tp, pp=pp, micro_batch_size=mbs, recompute=rc == 1,
                                 micro_batch_s=whole)


def _whole(est: Estimator, isl: int, tp: int, mbs: int, recompute: bool) -> float:
    c = est.cost(isl, tp, mbs, recompute)
    return (c.embedding_forward_s + c.embedding_backward_s + c.output_forward_s + c.output_backward_s
            + est.model.num_layers * (c.layer_forward_s + c.layer_backward_s))


def best_rate(est: Estimator, isl: int) -> tuple[float, Family | None]:
    """Island ``isl``'s best sequences per second per GPU over its families, and that family."""
    best, found = 0.0, None
    for f in _families(est, isl):
        rate = f.micro_batch_size / (f.micro_batch_s * f.tp)
        if rate > best:
            best, found = rate, f
    return best, found


def fluid_tokens_per_s(est: Estimator, islands: list[int]) -> float:
    """Tokens/s with every GPU of ``islands`` at its best rate, no whole sequences, no synchronisation."""
    seqs_per_s = sum(est.cluster.islands[i].num_gpus * best_rate(est, i)[0] for i in islands)
    return seqs_per_s * est.model.seq_length


def island_capacity(est: Estimator, isl: int, seconds: float) -> tuple[float, Family | None]:
    """Sequences island ``isl`` can complete within ``seconds`` with replicas of one family kept on
    the island (whole micro-batches; a pp-stage replica of ideally balanced stages takes
    ``(m + pp - 1) * micro_batch_s / pp`` for m of them), and the family. Fractional replicas are
    allowed, so this bounds every mix of families from above."""
    gpus = est.cluster.islands[isl].num_gpus
    best, found = 0.0, None
    for f in _families(est, isl):
        stage_s = f.micro_batch_s / f.pp
        m = int(seconds // stage_s) - (f.pp - 1) if seconds >= f.micro_batch_s else 0
        seqs = gpus / (f.tp * f.pp) * max(0, m) * f.micro_batch_size
        if seqs > best:
            best, found = seqs, f
    return best, found


def one_island_time(est: Estimator, islands: list[int], sequences: int, *, rel_tol: float = 1e-4) -> float:
    """The least time in which replicas kept on ``islands`` (each island its own family, see
    :func:`island_capacity`) complete ``sequences`` with no synchronisation: a lower bound of the
    pipeline time of any such plan. Bisection on the capacity's step function."""
    rate = sum(est.cluster.islands[i].num_gpus * best_rate(est, i)[0] for i in islands)
    if rate <= 0:
        return float("inf")
    lo, hi = sequences / rate, 2.0 * sequences / rate  # the fluid time is below the answer
    while sum(island_capacity(est, i, hi)[0] for i in islands) < sequences:
        lo, hi = hi, 2.0 * hi
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        if sum(island_capacity(est, i, mid)[0] for i in islands) >= sequences:
            hi = mid
        else:
            lo = mid
    return hi
