"""Megatron-LM's --profile: a capture window over iterations [--profile-step-start, --profile-step-end)
on --profile-ranks (every rank when none is given), as Megatron's training loop opens it.

- with --use-pytorch-profiler: torch's profiler on Megatron's schedule (wait until one iteration
  before the window, one warm-up iteration, then the window), its trace written where Megatron
  writes it: ``<--tensorboard-dir>/../torch_profile/rank-<R>.json.gz``;
- without: the capture range of NVIDIA's nsys (``cudaProfilerStart``/``Stop``; run under
  ``nsys profile --capture-range=cudaProfilerApi``). A host without a GPU has no such range: the run
  says so once at start-up (``arguments.py``) and nothing is captured.

The loop calls ``before(completed)`` before each iteration and ``after(completed)`` after it, with the
count of completed iterations, Megatron's ``iteration``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ProfileConfig", "StepProfiler"]


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """Megatron-LM's profiling flags of the same names."""

    step_start: int = 10  # --profile-step-start: the first iteration captured
    step_end: int = 12  # --profile-step-end: the capture stops once this many iterations are done
    ranks: tuple[int, ...] = ()  # --profile-ranks; empty: every rank
    pytorch_profiler: bool = False  # --use-pytorch-profiler (else the nsys capture range)
    trace_dir: str | None = None  # torch profiler traces (<--tensorboard-dir>/../torch_profile)
    collect_shapes: bool = False  # --pytorch-profiler-collect-shapes
    collect_callstack: bool = False  # --pytorch-profiler-collect-callstack

    def __post_init__(self) -> None:
        if not 0 <= self.step_start < self.step_end:
            raise ValueError(f"--profile-step-start {self.step_start} must be >= 0 and below --profile-step-end "
                             f"{self.step_end}. Fix: widen the window")
        if self.pytorch_profiler and not self.trace_dir:
            raise ValueError("--use-pytorch-profiler writes its trace beside --tensorboard-dir (as Megatron-LM). "
                             "Fix: add --tensorboard-dir DIR")


class StepProfiler:
    """The capture window of one rank (inert on ranks outside --profile-ranks)."""

    def __init__(self, config: ProfileConfig, *, rank: int, is_gpu: bool) -> None:
        self.config, self.rank = config, rank
        self.active = not config.ranks or rank in config.ranks
        self.nsys = self.active and not config.pytorch_profiler and is_gpu
        self.torch_profiler = None
        self.done = False
        if self.active and config.pytorch_profiler:
            c = config
            self.torch_profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=max(c.step_start - 1, 0), warmup=1 if c.step_start > 0 else 0,
                                                 active=c.step_end - c.step_start, repeat=1),
                on_trace_ready=self._write, record_shapes=c.collect_shapes, with_stack=c.collect_callstack)
            self.torch_profiler.start()

    def _write(self, prof) -> None:
        out = Path(self.config.trace_dir)
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / f"rank-{self.rank}.json.gz"))

    def before(self, completed: int) -> None:
        if self.done:
            return
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif self.nsys and completed == self.config.step_start:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())

    def after(self, completed: int) -> None:
        if self.done or completed != self.config.step_end:
            return
        self.close()

    def close(self) -> None:
        """End the capture (at --profile-step-end, or when the run ends first)."""
        if self.done:
            return
        self.done = True
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
        elif self.nsys:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
