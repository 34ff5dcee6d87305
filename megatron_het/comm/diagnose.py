"""Name the ranks that never reached a collective, from per-rank entry counters in the c10d store.

Each rank writes ``seq/<group rank> = n`` when it enters its n-th collective of a group. When a
phase fails (usually a gloo timeout), the failing rank reads the counters: every rank whose
counter is below n never arrived. The C++ backend does the same in ``HetBackend::diagnose``.
"""

from __future__ import annotations

import torch.distributed as dist


def seq_key(group_rank: int) -> str:
    """Store key holding the last collective number a group rank entered."""
    return f"seq/{group_rank}"


def record_entry(store: dist.Store, group_rank: int, seq: int) -> None:
    """Mark that `group_rank` entered collective number `seq`."""
    store.set(seq_key(group_rank), str(seq))


def ranks_behind(store: dist.Store, group_size: int, seq: int) -> list[tuple[int, int]]:
    """(group rank, last entered collective) for every rank that has not entered `seq`."""
    behind = []
    for r in range(group_size):
        try:
            theirs = int(store.get(seq_key(r))) if store.check([seq_key(r)]) else 0
        except Exception:  # the store itself is gone (its host exited): nothing more to learn
            continue
        if theirs < seq:
            behind.append((r, theirs))
    return behind


def failure_message(*, group: str, rank: int, op: str, seq: int, waited_s: float, timeout_s: float,
                    behind: list[tuple[int, int]], global_ranks: tuple[int, ...], cause: str) -> str:
    """One message naming the group, this rank, the missing ranks and the fix."""
    if behind:
        who = ", ".join(f"rank {global_ranks[r]} (group rank {r}, last entered #{n})" for r, n in behind)
        missing = f"ranks that never entered it: {who}"
    else:
        missing = "every rank entered it"
    return (f"het group '{group}': rank {rank} {op} #{seq} failed after {waited_s:.1f} s "
            f"(timeout {timeout_s:g} s); {missing}. Check that every rank of the group calls the "
            f"same collectives in the same order. Cause: {cause}")
