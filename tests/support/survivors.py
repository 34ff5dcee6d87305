"""Checks shared by the multi-process resilience tests on what the surviving ranks report."""

from __future__ import annotations


def assert_survivors_match(outcomes, ref: dict[int, float], iterations: int, rel: float = 1e-5) -> None:
    """Every rank that finished ("ok") logged iterations 1..``iterations`` with the failure-free run's loss
    ``ref[iteration]`` within ``rel`` relative."""
    for o in outcomes:
        if o.status != "ok":
            continue
        losses = o.result["report"].losses
        assert sorted(losses) == list(range(1, iterations + 1)), (o.rank, losses)
        for it, loss in losses.items():
            assert abs(loss - ref[it]) <= rel * abs(ref[it]), f"rank {o.rank} iteration {it}: {loss} vs {ref[it]}"
