"""Schedules as data: per-stage lists of F/B/W actions for one replica (pipeline)."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from megatron_het.schedule.errors import ScheduleError

ACTION_KINDS = ("F", "B", "W")  # forward; backward (input grad, or fused with W); weight grad only
_ACTION_RE = re.compile(r"^([FBW])(\d+)(?:\.(\d+))?$")


@dataclass(frozen=True, kw_only=True)
class Action:
    """One compute step of a stage on one micro-batch and model chunk."""

    # "F" forward; "B" backward (input grad, or fused input+weight grad when no W follows);
    # "W" weight gradient only (zero-bubble split backward)
    kind: str
    micro_batch: int  # index within this replica's micro-batches
    chunk: int = 0  # model chunk (virtual stage) for interleaved schedules

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ScheduleError(field="kind", value=self.kind, problem="unknown action kind",
                                fix="use one of " + ", ".join(ACTION_KINDS))
        for name in ("micro_batch", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ScheduleError(field=name, value=value, problem=f"{name} must be an integer >= 0",
                                    fix=f"use a {name} index starting at 0")

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str()``: "F3" -> F of micro-batch 3; "B3.1" -> B of micro-batch 3, chunk 1."""
        m = _ACTION_RE.match(text.strip())
        if not m:
            raise ScheduleError(field="action", value=text, problem="not an action",
                                fix='write kind + micro-batch [+ "." chunk], e.g. "F3", "B3", "W3.1"')
        return cls(kind=m.group(1), micro_batch=int(m.group(2)), chunk=int(m.group(3) or 0))


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Action lists for one replica; every rank of a stage (its TP group) runs the same list."""

    name: str  # generator name ("1f1b", "gpipe", "interleaved", "zb-h1") or "custom"
    num_stages: int  # pipeline stages of the replica
    num_micro_batches: int  # micro-batches per iteration for this replica
    num_chunks: int = 1  # model chunks per stage (virtual pipeline size)
    actions: tuple[tuple[Action, ...], ...]  # per stage, in execution order
    split_backward: bool = False  # True when B and W are separate actions
    # per stage, how many consecutive actions form each communication step (None: one each): the
    # executor posts one batch of transfers per neighbour between steps (schedule/transfers.py);
    # interleaved 1F1B's steady F/B pairs are one step each, as in megatron-core
    steps: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_micro_batches", "num_chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScheduleError(field=name, value=value, problem=f"{name} must be an integer >= 1",
                                    fix=f"set {name} to 1 or more")
        if len(self.actions) != self.num_stages:
            raise ScheduleError(
                field="actions", value=len(self.actions),
                problem=f"expected one action list per stage ({self.num_stages}), found {len(self.actions)}",
                fix="give exactly one action list per stage",
            )
        for s, sizes in enumerate(self.steps or ()):
            if len(self.steps) != self.num_stages or sum(sizes) != len(self.actions[s]) or min(sizes, default=1) < 1:
                raise ScheduleError(
                    field="steps", value=list(sizes),
                    problem=f"stage {s}'s steps must be positive and add up to its {len(self.actions[s])} actions, "
                    f"one list per stage ({self.num_stages}); they add up to {sum(sizes)}, {len(self.steps)} lists",
                    fix="give the size of every communication step of every stage, or steps=None (one action each)",
                )

    def step_sizes(self, stage: int) -> tuple[int, ...]:
        """Actions per communication step of ``stage`` (one each unless ``steps`` says otherwise)."""
        return self.steps[stage] if self.steps is not None else (1,) * len(self.actions[stage])

    def to_text(self) -> str:
        """One line per stage: ``stage 0: F0 F1 B0 ...``; a communication step of several actions is
        joined by ``+`` (``F3+B0``)."""
        lines = []
        for s, acts in enumerate(self.actions):
            bounds = [0, *itertools.accumulate(self.step_sizes(s))]
            lines.append(f"stage {s}: " + " ".join("+".join(str(a) for a in acts[i:j])
                                                   for i, j in zip(bounds, bounds[1:])))
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(
        cls,
        text: str,
        *,
        name: str = "custom",
        num_micro_batches: int | None = None,
        num_chunks: int | None = None,
    ) -> Schedule:
        """Parse :meth:`to_text` output; counts default to what the actions mention."""
        per_stage: list[tuple[Action, ...]] = []
        sizes: list[tuple[int, ...]] = []
        for lineno, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            head, sep, body = line.partition(":")
            if not sep or head.split() != ["stage", str(len(per_stage))]:
                raise ScheduleError(field=f"line {lineno}", value=line,
                                    problem=f"expected 'stage {len(per_stage)}: ...'",
                                    fix="write one 'stage N: A A A' line per stage, stages in order")
            steps = [tok.split("+") for tok in body.split()]
            per_stage.append(tuple(Action.parse(a) for step in steps for a in step))
            sizes.append(tuple(len(step) for step in steps))
        every = [a for acts in per_stage for a in acts]
        return cls(
            name=name,
            num_stages=len(per_stage),
            num_micro_batches=num_micro_batches or 1 + max((a.micro_batch for a in every), default=0),
            num_chunks=num_chunks or 1 + max((a.chunk for a in every), default=0),
            actions=tuple(per_stage),
            split_backward=any(a.kind == "W" for a in every),
            steps=tuple(sizes) if any(n > 1 for st in sizes for n in st) else None,
        )

    def peak_in_flight(self) -> tuple[int, ...]:
        """Per stage, the most micro-batch activations held at once (F done, its B not yet done)."""
        peaks = []
        for acts in self.actions:
            held = peak = 0
            for a in acts:
                held += 1 if a.kind == "F" else -1 if a.kind == "B" else 0
                peak = max(peak, held)
            peaks.append(peak)
        return tuple(peaks)
