"""Name the ranks that never reached a collective, from per-rank entry counters in the c10d store.

Each rank writes ``seq/<group rank> = n`` when it enters its n-th collective of a group. When a
phase fails (usually a gloo timeout), the failing rank reads the counters: every rank whose
counter is below n never arrived. The C++ backend does the same in ``HetBackend::diagnose``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


def seq_key(group_rank: int) -> str:
    """Store key holding the last collective number a group rank entered."""
    return f"seq/{group_rank}"


def record_entry(store: dist.Store, group_rank: int, seq: int) -> None:
    """Mark that `group_rank` entered collective number `seq`."""
    store.set(seq_key(group_rank), str(seq))


@dataclass(frozen=True, kw_only=True)
class Behind:
    """What the counters say about one failed collective."""

    ranks: list[tuple[int, int]]  # (group rank, last entered collective) of every rank known to be behind
    unreachable: str = ""  # why the store stopped answering ("" when every counter was read)
    unchecked_from: int | None = None  # first group rank not checked because the store stopped answering


def ranks_behind(store: dist.Store, group_size: int, seq: int) -> Behind:
    """Every rank that has not entered ``seq``; stops at the first store error (the store is gone:
    each further read would wait out its timeout again, once per rank)."""
    behind = []
    for r in range(group_size):
        try:
            raw = store.get(seq_key(r)) if store.check([seq_key(r)]) else b"0"
        except Exception as err:  # the store itself is gone (its host exited): nothing more to learn
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            return Behind(ranks=behind, unreachable=first, unchecked_from=r)
        try:
            theirs = int(raw)
        except ValueError:  # not a counter this code wrote: report it, do not crash the diagnosis
            theirs = -1
        if theirs < seq:
            behind.append((r, theirs))
    return Behind(ranks=behind)


def failure_message(*, group: str, rank: int, op: str, seq: int, waited_s: float, timeout_s: float,
                    behind: Behind, global_ranks: tuple[int, ...], cause: str) -> str:
    """One message naming the group, this rank, the missing ranks and the fix."""
    if behind.ranks:
        who = ", ".join(f"rank {global_ranks[r]} (group rank {r}, "
                        + (f"last entered #{n})" if n >= 0 else "counter unreadable)") for r, n in behind.ranks)
        missing = f"ranks that never entered it: {who}"
    else:
        missing = "no rank found behind" if behind.unreachable else "every rank entered it"
    if behind.unreachable:
        missing += (f"; the store is unreachable ({behind.unreachable}), group ranks {behind.unchecked_from}.."
                    f"{len(global_ranks) - 1} not checked")
    return (f"het group '{group}': rank {rank} {op} #{seq} failed after {waited_s:.1f} s "
            f"(timeout {timeout_s:g} s); {missing}. Check that every rank of the group calls the "
            f"same collectives in the same order. Cause: {cause}")
