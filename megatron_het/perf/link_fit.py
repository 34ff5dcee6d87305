"""Fit a ring link (per-step latency, bandwidth) to measured collective times.

A host profile times one collective kind at several buffer sizes and group sizes; this module
finds the ``Channel`` for which the ring formulas of ``perf/comm.py`` (the ones the models price
with) best match those times: ``t = steps(n) * L + factor(n) * bytes / B`` with ``steps``/``factor``
of the formula (all-reduce ``2(n-1)`` / ``2(n-1)/n``, all-gather ``n-1`` / ``(n-1)/n``), least
squares on the *relative* error so that the small, latency-bound samples weigh as much as the
large ones. ``fit_collective_links`` does it per collective kind and per group size (each size
timed at two or more buffer sizes gets its own links). Pure arithmetic; the timing is the
caller's (bench/overlap.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_het.perf.axonn import CollectiveLinks
from megatron_het.perf.comm import Channel

__all__ = ["CollectiveSample", "FORMULAS", "fit_collective_links", "fit_ring_link"]

# formula -> (steps(n), bytes factor(n)); "bytes" is the full buffer (gathered output, reduced input)
FORMULAS = {
    "all_reduce": (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    "all_gather": (lambda n: n - 1, lambda n: (n - 1) / n),
}


@dataclass(frozen=True, kw_only=True)
class CollectiveSample:
    """One measured collective."""

    ranks: int  # group size n (>= 2)
    nbytes: float  # full buffer bytes, as the formula takes them
    seconds: float  # measured time (a median over repeats)


def fit_ring_link(samples: Sequence[CollectiveSample], *, formula: str,
                  min_latency_us: float = 0.01, min_bandwidth_gbps: float = 1e-3) -> Channel:
    """The (latency, bandwidth) minimising ``sum(((model - t) / t)^2)`` over ``samples``.

    Both parameters are kept positive (clamped at ``min_*``, then the other refitted), so a sample
    set dominated by noise still gives a usable link.
    """
    if formula not in FORMULAS:
        raise ValueError(f"formula: must be one of {sorted(FORMULAS)}, got {formula!r}. Fix: pick the ring formula "
                         f"the model prices this collective with")
    for s in samples:
        if s.ranks < 2 or s.seconds <= 0 or s.nbytes < 0:
            raise ValueError(f"samples: need ranks >= 2, seconds > 0, bytes >= 0, got ranks={s.ranks}, "
                             f"seconds={s.seconds}, bytes={s.nbytes} (limit 2 ranks). Fix: drop one-rank "
                             f"or failed measurements")
    steps_of, factor_of = FORMULAS[formula]
    # rows a = steps/t, b = factor*bytes/t, target 1: minimise sum((a*L + b*beta - 1)^2)
    rows = [(steps_of(s.ranks) / s.seconds, factor_of(s.ranks) * s.nbytes / s.seconds) for s in samples]
    saa = sum(a * a for a, _ in rows)
    sbb = sum(b * b for _, b in rows)
    sab = sum(a * b for a, b in rows)
    sa = sum(a for a, _ in rows)
    sb = sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    if not det > 1e-9 * saa * sbb:  # every sample has the same bytes per latency step
        raise ValueError(f"samples: need 2 or more points with different bytes per ring step, got {len(samples)} "
                         f"sample(s) on one line. Fix: time the collective at two or more buffer sizes")
    lat = (sa * sbb - sb * sab) / det
    beta = (sb * saa - sa * sab) / det
    lat_min, beta_max = min_latency_us * 1e-6, 8 / (min_bandwidth_gbps * 1e9)
    if lat < lat_min:  # refit the bandwidth alone
        lat = lat_min
        beta = (sb - lat * sab) / sbb
    if beta <= 0:  # latency alone explains the times: refit it, bandwidth at its cap
        beta = 8 / (1e6 * 1e9)  # 1 Pbit/s: transfer time negligible
        lat = max(lat_min, (sa - beta * sab) / saa)
    beta = min(beta, beta_max)
    return Channel(bandwidth_gbps=8 / beta / 1e9, latency_us=lat * 1e6, host_staged=False)


def fit_collective_links(samples: Mapping[str, Sequence[CollectiveSample]], *, formulas: Mapping[str, str],
                         per_group_size: bool = True) -> CollectiveLinks:
    """``CollectiveLinks`` fitted to timed collectives, ``samples[kind]`` for each of ``all_gather``,
    ``all_reduce``, ``reduce_scatter``, each kind with the ring formula ``formulas[kind]``.

    The fields are fitted over every group size together; with ``per_group_size``, each group size
    timed at two or more buffer sizes in every kind also gets links fitted on its samples only
    (``CollectiveLinks.by_group_size``), which the model then uses for groups of that size.
    """
    kinds = ("all_gather", "all_reduce", "reduce_scatter")
    missing = [k for k in kinds if k not in samples or k not in formulas]
    if missing:
        raise ValueError(f"samples/formulas: need all {len(kinds)} collective kinds, missing {missing} "
                         f"({len(missing)} of {len(kinds)}). Fix: time and name every kind the model prices")
    pooled = {k: fit_ring_link(samples[k], formula=formulas[k]) for k in kinds}
    by_size = {}
    if per_group_size:
        sizes = set.intersection(*({s.ranks for s in samples[k]} for k in kinds))
        for n in sorted(sizes):
            sub = {k: [s for s in samples[k] if s.ranks == n] for k in kinds}
            if all(len({s.nbytes for s in v}) >= 2 for v in sub.values()):
                by_size[n] = CollectiveLinks(**{k: fit_ring_link(v, formula=formulas[k]) for k, v in sub.items()})
    return CollectiveLinks(**pooled, by_group_size=by_size)
