"""Fit the compute model's per-device figures to published runs (tools/calibrate.py, bench/published.py).

What is fitted (:data:`PARAMETERS`, in log space, each with a prior): the 16-bit GEMM efficiency of
the A100 (A100-40GB and A100-80GB share a die); the H100's 16-bit efficiency relative to the A100's;
fp8's efficiency relative to 16-bit on the same part; fused attention's efficiency relative to the
16-bit GEMMs; the per-kernel fixed cost. Ratios rather than free figures per device let a source
that is left out still be priced from what the others say about the same die or precision.

Objective (a maximum a posteriori fit): the sum over rows of ``(log(predicted / published) / 0.1)^2``
(a row is believed to ~10%) plus ``((theta - prior) / 0.3)^2`` per parameter in log space (priors are
believed to ~30%), so a parameter no row informs stays at its prior. Minimised by Nelder-Mead on a
linearised predictor: each row's iteration time is expanded around a reference point as
``T_ref + dT/dS * (S - S_ref)``, ``S`` its first stage's per-micro-batch compute, which costs
microseconds per evaluation; the reference is recomputed with the full predictor and the fit
repeated until it settles (three rounds), and every reported figure comes from the full predictor.

Leave-one-source-out: fit on every source but one, price the one left out; the error on rows no fit
has seen is what bench/published.py reports against the acceptance targets.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from megatron_het.perf.compute import PRIORS, ComputeParams
from megatron_het.perf.predict import stage_cost
from megatron_het.perf.profile import Profile
from megatron_het.perf.published import PublishedRow, predict_row

__all__ = ["PARAMETERS", "FAMILIES", "FitResult", "device_params", "profiles_for", "fit", "leave_one_source_out",
           "row_errors", "summary"]

# name -> (prior, what it is)
PARAMETERS: dict[str, tuple[float, str]] = {
    "a100_16bit_gemm": (0.8, "A100 16-bit GEMM efficiency (fraction of 312 TFLOP/s) for large GEMMs"),
    "h100_over_a100": (0.85, "H100 16-bit GEMM efficiency / A100's (Hopper reaches a lower share of its peak)"),
    "fp8_over_16bit": (0.75, "fp8 GEMM efficiency (of the fp8 rate) / 16-bit GEMM efficiency (of the 16-bit rate)"),
    "attention_over_gemm": (0.6, "fused attention efficiency on its causal FLOPs / 16-bit GEMM efficiency"),
    "kernel_overhead_us": (6.0, "fixed cost of every kernel, microseconds"),
}
_NAMES = tuple(PARAMETERS)
ROW_SIGMA = 0.1  # log error a row is believed to within
PRIOR_SIGMA = 0.3  # log error a prior is believed to within

# Device types the fit covers: family -> catalog names sharing its figures.
FAMILIES = {"A100": ("A100-40GB", "A100-80GB"), "H100": ("H100-SXM", "H200")}

# Fused attention written for Hopper (warp specialisation, TMA, wgmma: FlashAttention-3, cuDNN 9's
# fused attention, which Transformer Engine runs on H100) over FlashAttention-2's Ampere design on the
# same H100: Shah et al. 2024, "FlashAttention-3" (arXiv:2407.08608), abstract: "1.5-2.0x" faster in
# 16-bit (FlashAttention-2 "only 35% utilization" on H100). The low end is taken; not fitted.
HOPPER_ATTENTION_SPEEDUP = 1.5
ATTENTION_KERNELS = ("fa2", "hopper")  # a row's fused attention kernel design (published.py)


def device_params(theta: Mapping[str, float], *, source: str = "fit", attention_kernel: str = "hopper",
                  fused_norm_casts: bool = True) -> dict[str, dict[str, ComputeParams]]:
    """Device type name -> precision class -> ComputeParams for the parameter values ``theta``.

    ``attention_kernel``: the fused attention the H100 family runs ("hopper": a Hopper-native kernel,
    what megatron-core's Transformer Engine spec uses, the shipped default; "fa2": FlashAttention-2).
    ``attention_over_gemm`` is the FlashAttention-2-class figure (the A100's kernel).
    ``fused_norm_casts``: the run's norms write fp8 for QKV and fc1 (megatron-core's TE spec, the
    shipped default) rather than each te.Linear casting its input (see ComputeParams)."""
    if attention_kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention_kernel={attention_kernel!r} is not one of {ATTENTION_KERNELS}. "
                         "Fix: use 'hopper' or 'fa2'")
    def clip(x: float) -> float:
        return min(1.0, max(1e-3, x))

    a16 = clip(theta["a100_16bit_gemm"])
    h16 = clip(a16 * theta["h100_over_a100"])
    base = PRIORS["nvidia"]["16bit"]
    k = max(0.0, theta["kernel_overhead_us"])

    def params(gemm: float, sixteen: float, attention_speedup: float = 1.0) -> ComputeParams:
        return ComputeParams(gemm_efficiency=clip(gemm),
                             attention_efficiency=clip(sixteen * theta["attention_over_gemm"] * attention_speedup),
                             kernel_overhead_us=k, memory_efficiency=base.memory_efficiency, k_half=base.k_half,
                             elementwise_kernels=base.elementwise_kernels, fused_norm_casts=fused_norm_casts,
                             source=source)

    out: dict[str, dict[str, ComputeParams]] = {}
    for name in FAMILIES["A100"]:
        out[name] = {"16bit": params(a16, a16)}
    hop = HOPPER_ATTENTION_SPEEDUP if attention_kernel == "hopper" else 1.0
    for name in FAMILIES["H100"]:
        out[name] = {"16bit": params(h16, h16, hop), "fp8": params(h16 * theta["fp8_over_16bit"], h16, hop)}
    return out


def profiles_for(theta: Mapping[str, float], *, source: str = "fit", attention_kernel: str = "hopper",
                 fused_norm_casts: bool = True) -> list[Profile]:
    """One entry-less profile per fitted device type, carrying its compute_model."""
    return [Profile(device=name, entries=(), method="compute model fit", compute_model=cm, source=source,
                    compute_method=source)
            for name, cm in device_params(theta, source=source, attention_kernel=attention_kernel,
                                          fused_norm_casts=fused_norm_casts).items()]


def _row_profiles(theta: Mapping[str, float]) -> Callable[[PublishedRow], list[Profile]]:
    """The profiles each row is priced with: its software stack (attention kernel, fp8 casts) picks
    the stack-dependent figures; the fitted ones are shared."""
    by_stack = {(kernel, fused): profiles_for(theta, attention_kernel=kernel, fused_norm_casts=fused)
                for kernel in ATTENTION_KERNELS for fused in (True, False)}
    return lambda row: by_stack[(row.attention_kernel, row.fused_norm_casts)]


def _stage_seconds(row: PublishedRow, profiles: Sequence[Profile]) -> float:
    """First stage's forward + backward seconds per micro-batch (the quantity compute scales)."""
    st = row.plan.replicas[0].stages[0]
    island = row.cluster.island(st.island)
    c = stage_cost(row.model, island, tp=st.tp, micro_batch_size=row.plan.micro_batch_size,
                   recompute=row.recompute, sequence_parallel=row.plan.sequence_parallel,
                   tp_comm_overlap=st.tp_comm_overlap, profile=profiles, precision=row.precision,
                   flash_attention=row.flash_attention,
                   recompute_share=st.recomputed_layers(row.plan.virtual_pipeline_size) / st.num_layers
                   if st.recompute_num_layers else 1.0)
    last = len(row.plan.replicas[0].stages) == 1
    return (c.forward_s(st.num_layers, is_first=True, is_last=last)
            + c.backward_s(st.num_layers, is_first=True, is_last=last))


def _exact(rows: Sequence[PublishedRow], theta: Mapping[str, float]) -> list[float]:
    profiles = _row_profiles(theta)
    return [predict_row(r, profile=profiles(r)).iteration_time_s for r in rows]


def _nelder_mead(f: Callable[[list[float]], float], x0: list[float], *, step: float = 0.1, iters: int = 600,
                 tol: float = 1e-7) -> list[float]:
    n = len(x0)
    simplex = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if abs(values[-1] - values[0]) < tol:
            break
        centroid = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]
        refl = [c + (c - w) for c, w in zip(centroid, worst)]
        fr = f(refl)
        if fr < values[0]:
            exp = [c + 2 * (c - w) for c, w in zip(centroid, worst)]
            fe = f(exp)
            simplex[-1], values[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = refl, fr
        else:
            con = [c + 0.5 * (w - c) for c, w in zip(centroid, worst)]
            fc = f(con)
            if fc < values[-1]:
                simplex[-1], values[-1] = con, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, p)] for p in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]


@dataclass(frozen=True)
class FitResult:
    theta: dict[str, float]  # fitted parameter values
    rows: tuple[str, ...]  # row keys fitted on
    sources: tuple[str, ...]  # sources fitted on
    objective: float  # final (linearised) objective


def fit(rows: Sequence[PublishedRow], *, rounds: int = 3) -> FitResult:
    """Maximum a posteriori parameters for ``rows`` (see the module docstring)."""
    priors = {k: v for k, (v, _) in PARAMETERS.items()}
    x = [math.log(priors[k]) for k in _NAMES]
    if not rows:
        return FitResult(theta=priors, rows=(), sources=(), objective=0.0)
    published = [r.published_iteration_s for r in rows]
    objective = 0.0
    for _ in range(rounds):
        theta = dict(zip(_NAMES, map(math.exp, x)))
        ref = _exact(rows, theta)
        ref_profiles = _row_profiles(theta)
        s_ref = [_stage_seconds(r, ref_profiles(r)) for r in rows]
        pert = dict(theta, a100_16bit_gemm=theta["a100_16bit_gemm"] * 0.85)
        t_pert = _exact(rows, pert)
        pert_profiles = _row_profiles(pert)
        s_pert = [_stage_seconds(r, pert_profiles(r)) for r in rows]
        slope = [(tp - t) / (sp - s) if abs(sp - s) > 1e-15 else (t / s if s > 0 else 0.0)
                 for t, tp, s, sp in zip(ref, t_pert, s_ref, s_pert)]

        def objective_of(v: list[float]) -> float:
            th = dict(zip(_NAMES, map(math.exp, v)))
            profiles = _row_profiles(th)
            total = sum(((vi - math.log(priors[k])) / PRIOR_SIGMA) ** 2 for vi, k in zip(v, _NAMES))
            for r, t0, s0, k, pub in zip(rows, ref, s_ref, slope, published):
                t = t0 + k * (_stage_seconds(r, profiles(r)) - s0)
                t = max(t, 1e-3 * t0)
                total += (math.log(t / pub) / ROW_SIGMA) ** 2
            return total

        x = _nelder_mead(objective_of, x)
        objective = objective_of(x)
    theta = dict(zip(_NAMES, map(math.exp, x)))
    return FitResult(theta=theta, rows=tuple(r.key for r in rows),
                     sources=tuple(sorted({r.source for r in rows})), objective=objective)


def row_errors(rows: Sequence[PublishedRow], theta: Mapping[str, float]) -> list[tuple[PublishedRow, float, float]]:
    """(row, predicted iteration seconds, relative error) with the full predictor at ``theta``."""
    pred = _exact(rows, theta)
    return [(r, p, p / r.published_iteration_s - 1.0) for r, p in zip(rows, pred)]


def leave_one_source_out(rows: Sequence[PublishedRow]) -> dict[str, tuple[FitResult, list[tuple[PublishedRow, float, float]]]]:
    """source -> (fit on the other sources, errors on this source's rows)."""
    out = {}
    for source in sorted({r.source for r in rows}):
        train = [r for r in rows if r.source != source]
        test = [r for r in rows if r.source == source]
        result = fit(train)
        out[source] = (result, row_errors(test, result.theta))
    return out


def summary(errors: Sequence[float]) -> dict[str, float]:
    a = [abs(e) for e in errors]
    return {"median_abs": statistics.median(a), "worst_abs": max(a), "rows": len(a)}
