"""What a rank holds, counted exactly (CPU-checkable): the runtime side of the memory model.

Components (bytes on this rank), the same names as ``perf.memory.StageMemory``:

- ``parameters``: the model's parameters (half precision under ``--bf16``/``--fp16``);
- ``gradients``: the gradients the optimizer reads: the parameters' ``.grad`` in fp32, the fp32 main
  gradients in mixed precision (the half-precision gradient lives one backward and is not kept);
- ``optimizer``: Adam's two moments plus fp32 main values where they are separate tensors (mixed
  precision; the distributed optimizer's fp32 shard in every precision), only this rank's pieces
  with the distributed optimizer;
- ``activations``: tensors autograd saves for backward, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` around whatever the schedule executor runs (1F1B,
  interleaved, zero-bubble alike), de-duplicated by storage, parameters excluded (they are counted
  above); a saved tensor is live from its pack until autograd drops it. Reported at the peak of an
  iteration and per micro-batch (the most any one forward action left saved until the next action).

The first three are counted by walking the tensors the strategy owns (each storage once). Torch's
allocator slack, the pipeline's boundary buffers and a stage's output tensors kept for the backward
are not in any component (the model does not price them either).

``MemoryProbe`` is a ``TrainerHooks``: pass it as ``hooks=`` (or chain it) and read ``report()``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from megatron_het.train.trainer import TrainerHooks

__all__ = ["MemoryProbe", "MemoryReport", "owned_state_bytes", "gathered_report_lines"]


@dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """Bytes one rank holds, by component (``perf.memory.StageMemory``'s names)."""

    rank: int  # global rank
    parameters_bytes: int  # model parameters
    gradients_bytes: int  # gradients the optimizer reads (fp32 main gradients in mixed precision)
    optimizer_bytes: int  # Adam moments + separate fp32 main values (this rank's shard when distributed)
    activations_bytes: int  # saved-for-backward bytes at the iteration's peak
    activations_per_microbatch_bytes: int  # most saved bytes any one forward action added

    @property
    def total_bytes(self) -> int:
        return self.parameters_bytes + self.gradients_bytes + self.optimizer_bytes + self.activations_bytes

    def parts(self) -> dict[str, int]:
        return {"parameters": self.parameters_bytes, "gradients": self.gradients_bytes,
                "optimizer": self.optimizer_bytes, "activations": self.activations_bytes}

    def line(self) -> str:
        mib = 2.0 ** 20
        return (f"[Rank {self.rank}] held (MiB) | parameters: {self.parameters_bytes / mib:.2f} | gradients: "
                f"{self.gradients_bytes / mib:.2f} | optimizer: {self.optimizer_bytes / mib:.2f} | activations peak: "
                f"{self.activations_bytes / mib:.2f} (per micro-batch {self.activations_per_microbatch_bytes / mib:.2f})")


def _key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (s.device.type, s.device.index, s.data_ptr())


def _bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (each counted once)."""
    seen: dict[tuple, int] = {}
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        seen.setdefault(_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


def owned_state_bytes(strategy) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer) bytes a pipeline strategy holds, walking its tensors."""
    params = list(strategy.params.values())
    parameters = _bytes(params)
    sync, main = strategy.sync, strategy.main
    if main is not None and hasattr(main, "grads"):  # distributed optimizer in mixed precision
        grads = list(main.grads.values())
    elif main is not None:
        grads = [m.grad for m in main.main.values()]
    else:
        grads = [p.grad for p in params]
    gradients = _bytes(grads)
    if hasattr(sync, "adam"):  # distributed optimizer: only this rank's pieces
        a = sync.adam
        optimizer = _bytes([a.master, a.exp_avg, a.exp_avg_sq])
    else:
        state = [t for st in strategy.optimizer.state.values() for k, t in st.items()
                 if k in ("exp_avg", "exp_avg_sq")]
        values = list(main.main.values()) if main is not None else []
        optimizer = _bytes(state + values)
    return parameters, gradients, optimizer


class _Saved:
    """A packed saved tensor; its release (autograd drops the saved variable) ends its life."""

    __slots__ = ("tensor", "probe", "key")

    def __init__(self, tensor: torch.Tensor, probe: MemoryProbe, key) -> None:
        self.tensor, self.probe, self.key = tensor, probe, key

    def __del__(self) -> None:
        if self.key is not None:
            self.probe._release(self.key)


class MemoryProbe(TrainerHooks):
    """Counts saved activations during each step (saved-tensor hooks) and reports what the rank holds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[tuple, list[int]] = {}  # storage key -> [bytes, references]
        self._live_bytes = 0
        self._param_keys: set[tuple] = set()
        self._ctx = None
        self._marks: list[tuple[object, int]] = []  # (action, live bytes before it) this iteration
        self.peak_bytes = 0  # saved-for-backward peak over the steps seen
        self.per_microbatch_bytes = 0  # largest forward action's increase over the steps seen
        self._strategy = None

    # ---- saved-tensor hooks ----------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        if t.numel() == 0 or t.device.type == "meta":
            return _Saved(t, self, None)
        k = _key(t)
        if k in self._param_keys:
            return _Saved(t, self, None)
        with self._lock:
            entry = self._live.get(k)
            if entry is None:
                self._live[k] = [t.untyped_storage().nbytes(), 1]
                self._live_bytes += self._live[k][0]
                self.peak_bytes = max(self.peak_bytes, self._live_bytes)
            else:
                entry[1] += 1
        return _Saved(t, self, k)

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _release(self, k) -> None:
        with self._lock:
            entry = self._live.get(k)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                self._live_bytes -= entry[0]
                del self._live[k]

    # ---- trainer hooks -------------------------------------------------------------------------
    def on_step_start(self, trainer, iteration: int) -> None:
        self._strategy = trainer.strategy
        self._param_keys = {_key(p) for p in trainer.strategy.params.values()}
        self._marks = []
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()

    def on_action(self, trainer, iteration: int, index: int, action) -> None:
        self._marks.append((action, self._live_bytes))

    def on_step_end(self, trainer, log) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None
        marks = self._marks + [(None, self._live_bytes)]
        for (action, before), (_, after) in zip(marks, marks[1:]):
            if getattr(action, "kind", None) == "F":
                self.per_microbatch_bytes = max(self.per_microbatch_bytes, after - before)

    def on_failure(self, trainer, iteration: int, error: BaseException) -> bool:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None
        return False

    def report(self) -> MemoryReport:
        """What the rank holds now (after a step) and the activation figures of the steps seen."""
        parameters, gradients, optimizer = owned_state_bytes(self._strategy)
        return MemoryReport(rank=self._strategy.rank, parameters_bytes=parameters, gradients_bytes=gradients,
                            optimizer_bytes=optimizer, activations_bytes=self.peak_bytes,
                            activations_per_microbatch_bytes=self.per_microbatch_bytes)


def gathered_report_lines(probe: MemoryProbe, model, plan) -> list[str]:
    """Every rank's report beside ``perf.memory.rank_memory``'s prediction for it, gathered (collective);
    rank 0 gets one line per rank, the others an empty list."""
    import torch.distributed as dist

    from megatron_het.perf.memory import rank_memory

    mine = probe.report()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return []
    vocab = probe._strategy.stage.vocab_size
    lines = ["memory held per rank, measured / predicted by perf.memory.rank_memory (MiB):"]
    mib = 2.0 ** 20
    for rep in gathered:
        pred = rank_memory(model, plan, rep.rank, padded_vocab=vocab)
        cells = " | ".join(f"{k}: {v / mib:.2f} / {getattr(pred, f'{k}_bytes') / mib:.2f}"
                           for k, v in rep.parts().items())
        lines.append(f"  [Rank {rep.rank}] {cells}")
    return lines
