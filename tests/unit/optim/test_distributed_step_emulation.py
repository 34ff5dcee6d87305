"""The distributed optimizer's step under an emulated device: only the local update is stretched.

A slower device updates its shard slower (EmulationTimer.stretch: its CPU time x slowdown, priced as
optimizer_step_s x slowdown); the all-gather of the updated values is communication, priced on the links,
so it must run outside the stretched section (stretched, it cost the demo's ranks 32-36 ms an iteration
instead of the 12.9 ms priced)."""

from types import SimpleNamespace

import torch

from megatron_het.optim.distributed import DistributedOptimizer
from megatron_het.train.timer import EmulationTimer


def _stub(log: list[str], *, overlap: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        finish_param_gather=lambda: log.append("finish"), _master=lambda: log.append("master"),
        adam=SimpleNamespace(step=lambda grad, lr, decoupled_lr=None: log.append(f"adam lr={lr}"),
                             master=torch.zeros(2)),
        shard_grad=torch.ones(2), param_groups=[{"lr": 0.5}], overlap_param_gather=overlap,
        _all_gather_into=lambda shard, sink: log.append("gather"), _write_params=None,
        _start_gathers=lambda shard: log.append("start gathers"),
        _release_master=lambda: log.append("release"), _empty=lambda: torch.zeros(0))


def test_only_the_local_update_runs_inside_compute():
    log: list[str] = []

    def compute(fn):
        log.append("compute(")
        out = fn()
        log.append(")")
        return out

    stub = _stub(log)
    DistributedOptimizer.step(stub, compute=compute)
    assert log == ["finish", "compute(", "master", "adam lr=0.5", ")", "gather", "release"]
    assert stub.shard_grad.numel() == 0  # the reduced pieces are released after the step
    log.clear()
    DistributedOptimizer.step(_stub(log, overlap=True), compute=compute)
    assert log == ["finish", "compute(", "master", "adam lr=0.5", ")", "start gathers", "release"]
    log.clear()
    DistributedOptimizer.step(_stub(log))  # no timer: the same work, unwrapped
    assert log == ["finish", "master", "adam lr=0.5", "gather", "release"]


def test_an_emulated_timer_stretches_the_update_and_not_the_gather(monkeypatch):
    """With a 4x device on the thread clock, the waits added follow the update's CPU time only."""
    timer = EmulationTimer(slowdown=4.0, clock=lambda: clock[0])
    clock = [0.0]
    slept: list[float] = []
    monkeypatch.setattr("megatron_het.train.timer.time.sleep", lambda s: slept.append(s))
    stub = _stub([])
    stub._master = lambda: clock.__setitem__(0, clock[0] + 0.010)  # 10 ms of CPU in the update
    stub._all_gather_into = lambda shard, sink: clock.__setitem__(0, clock[0] + 1.0)  # 1 s in the gather
    DistributedOptimizer.step(stub, compute=timer.stretch)
    # 4 x 10 ms of CPU, less the (real, tiny) wall time it took; with the gather inside it would be ~4 s
    assert len(slept) == 1 and 0.02 < slept[0] <= 0.040
    assert timer.emulated_s == slept[0]
