"""How far a run's final parameters are from a reference's, per tensor (the parity tests' parameter metric),
and how far a run and the fp32 reference each are from the float64 truth (workers/f64_workers.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def relative_norms(final: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor ||p - p_ref||_2 / ||p_ref||_2 (Frobenius norms over the whole tensor, computed in float64).

    Unlike max|diff| / max|ref| this does not make one element's round-off the whole tensor's figure, and
    unlike an element-wise relative bound it is defined for parameters that are (near) zero somewhere."""
    out = {}
    for k, want in ref.items():
        w, got = want.double(), final[k].double()
        out[k] = float((got - w).norm() / max(float(w.norm()), 1e-300))
    return out


def global_relative_norm(final: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """||p - p_ref||_2 / ||p_ref||_2 over all tensors of ``ref`` as one vector (float64)."""
    num = sum(float(((final[k].double() - w.double()) ** 2).sum()) for k, w in ref.items())
    den = sum(float((w.double() ** 2).sum()) for w in ref.values())
    return (num / max(den, 1e-300)) ** 0.5


# A run is "as accurate as the fp32 reference" when, against the float64 truth, its error over all
# parameters is at most TRUTH_GLOBAL_FACTOR x the reference's, and every tensor's error at most
# TRUTH_TENSOR_FACTOR x max(the reference's error of that tensor, the reference's error over all
# parameters): per tensor one fp32 run can land 7x closer to the truth than another, so the per-tensor
# limit is loose. The spread it must cover, measured 2026-11-29 from fresh seeded starts (issue #39):
# correct runs of tests/multiproc/test_schedules_parity.py 1.16..1.80 x over all parameters on this
# machine's AVX2 kernels, 0.94..1.33 x with ATen's scalar kernels (ATEN_CPU_CAPABILITY=default),
# 1.19..1.52 x with oneDNN at SSE4.1 and MKL_CBWR=COMPATIBLE, and 2.23 x on another machine (the
# issue's report); per tensor at most 3.55 x. The weakest injected fault (tests/multiproc/
# test_fp32_floor.py: one norm bias's learning rate 1% off) is 15.9 x over all and 16246 x on its tensor.
# 4 x is 1.8 x above the worst correct run and 4 x below that fault. Worker processes run one thread
# each (platform/local_launch.py), so OMP_NUM_THREADS does not move these.
TRUTH_GLOBAL_FACTOR = 4.0
TRUTH_TENSOR_FACTOR = 20.0


@dataclass(frozen=True, kw_only=True)
class TruthComparison:
    """A run's and the fp32 reference's distances to the float64 truth (relative norms)."""

    run: dict[str, float]  # per tensor ||p_run - p_truth|| / ||p_truth||
    ref: dict[str, float]  # per tensor ||p_ref - p_truth|| / ||p_truth||
    run_all: float  # the run's, over all parameters together
    ref_all: float  # the reference's, over all parameters together

    @property
    def global_ratio(self) -> float:
        return self.run_all / max(self.ref_all, 1e-300)

    def tensor_ratios(self) -> dict[str, float]:
        """Per tensor: the run's error / max(the reference's error of that tensor, its error over all)."""
        return {k: v / max(self.ref[k], self.ref_all, 1e-300) for k, v in self.run.items()}

    def violations(self) -> list[str]:
        """What breaks the "as accurate as the fp32 reference" criterion (empty: none)."""
        out = []
        if self.global_ratio > TRUTH_GLOBAL_FACTOR:
            out.append(f"all parameters: {self.run_all:.3e} vs the truth, {self.global_ratio:.2f} x the fp32 "
                       f"reference's {self.ref_all:.3e} (limit {TRUTH_GLOBAL_FACTOR} x)")
        for k, r in self.tensor_ratios().items():
            if r > TRUTH_TENSOR_FACTOR:
                out.append(f"{k}: {self.run[k]:.3e} vs the truth, {r:.1f} x max(reference's {self.ref[k]:.3e}, "
                           f"{self.ref_all:.3e}) (limit {TRUTH_TENSOR_FACTOR} x)")
        return out

    def summary(self, name: str) -> str:
        ratios = self.tensor_ratios()
        worst = max(ratios, key=ratios.get)
        far = max(self.run, key=self.run.get)
        return (f"{name} vs float64 truth: all parameters {self.run_all:.3e} (fp32 reference {self.ref_all:.3e}, "
                f"x{self.global_ratio:.2f}); worst tensor {far} {self.run[far]:.2e} (reference {self.ref[far]:.2e}); "
                f"reference's worst {max(self.ref.values()):.2e}; largest per-tensor ratio {ratios[worst]:.2f} at "
                f"{worst} ({self.run[worst]:.2e} vs reference {self.ref[worst]:.2e})")


def compare_to_truth(run: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                     truth: dict[str, torch.Tensor]) -> TruthComparison:
    """``run`` and ``ref`` (the fp32 reference) against ``truth``; all three full states of the same names."""
    if set(run) != set(truth) or set(ref) != set(truth):
        raise ValueError(f"full states differ in names: run {sorted(set(run) ^ set(truth))}, "
                         f"reference {sorted(set(ref) ^ set(truth))}. Fix: compare states of one model")
    return TruthComparison(run=relative_norms(run, truth), ref=relative_norms(ref, truth),
                           run_all=global_relative_norm(run, truth), ref_all=global_relative_norm(ref, truth))


def assert_final_parameters(name: str, final: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                            truth: dict[str, torch.Tensor]) -> None:
    """The parity tests' parameter checks, printed and asserted: the same tensors; every element within 1e-4
    absolute of the fp32 reference; all parameters as one vector within 1e-5 relative (the issues' bound; per
    tensor the fp32 floor is above it); as close to the float64 ``truth`` as the reference (TruthComparison)."""
    assert set(final) == set(ref), set(final) ^ set(ref)
    diffs = {k: float((final[k] - ref[k]).abs().max()) for k in ref}
    worst = max(diffs, key=diffs.get)
    norms = relative_norms(final, ref)
    worst_norm = max(norms, key=norms.get)
    overall = global_relative_norm(final, ref)
    print(f"{name}: max |param diff| {diffs[worst]:.2e} at {worst}; max ||p - p_ref|| / ||p_ref|| "
          f"{norms[worst_norm]:.2e} at {worst_norm} ({sum(v > 1e-5 for v in norms.values())} of {len(norms)} "
          f"tensors above 1e-5; matrices at most {max(v for k, v in norms.items() if final[k].dim() >= 2):.2e}); "
          f"over all parameters {overall:.2e}")
    assert diffs[worst] < 1e-4, f"{name}: {worst} differs by {diffs[worst]}"
    assert overall <= 1e-5, f"{name}: final parameters {overall:.2e} from the reference (relative, all together)"
    vs_truth = compare_to_truth(final, ref, truth)
    print(vs_truth.summary(name))
    assert vs_truth.violations() == [], f"{name}: {vs_truth.violations()}"


def assert_seeded_start(initial_shards, *, model, seed: int, padded_vocab: int) -> None:
    """The single-process reference's initial parameters are the seeded full model of ``seed``
    (runtime/initial_values.py) bit for bit, so a parity run given no state starts where it did:
    the parity suites then test the fresh start a user's run takes (issue #34)."""
    from megatron_het.checkpoint.full_state import assemble_full_state
    from megatron_het.runtime.initial_values import SeededFullState

    initial = assemble_full_state([initial_shards])
    seeded = SeededFullState(model, seed=seed, padded_vocab=padded_vocab)
    assert set(initial) == set(seeded)
    for name, value in initial.items():
        assert torch.equal(value.float(), seeded[name].to(value.dtype).float()), f"reference's initial {name}"


def reported_losses(per_rank, name: str) -> list[float]:
    """Loss list of case ``name`` from a rank that reports it (runtime: every rank; megatron: last stage);
    ``per_rank``: each rank's {case name: (RunResult, ...)}."""
    for rank_out in reversed(per_rank):
        losses = [log.lm_loss for log in rank_out[name][0].iterations]
        if all(v is not None for v in losses):
            return losses
    raise AssertionError(f"{name}: no rank reported losses")


def assert_losses_match(name: str, losses: list[float], ref_losses: list[float], iters: int) -> None:
    """Every iteration's loss within 1e-5 relative of the single-process run's (fp32 parity)."""
    assert len(losses) == iters
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{name} iteration {i + 1}: {a} vs single-process {b}"
