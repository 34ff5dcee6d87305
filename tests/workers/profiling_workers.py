"""Rank functions for tests/multiproc/test_profiling_in_run.py (importable by spawned processes)."""

from __future__ import annotations

import time


def in_run_profile_worker(rank, world_size, model, slowdowns):
    """profile_in_rank on every rank at once, each with its own slowdown: (profile as a dict, groups alive
    before and after, wall seconds, thread CPU seconds of the call)."""
    from megatron_het.perf.profile import profile_to_dict
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.profiling.in_run import profile_in_rank
    from megatron_het.runtime.group_ledger import live_groups

    enable_cpu_backend()
    before = len(live_groups())
    w0, c0 = time.perf_counter(), time.thread_time()
    profile = profile_in_rank(model, slowdown=slowdowns[rank], num_layers=2, micro_batch_sizes=[2], device="CPU",
                              warmup=1, repeats=3, optimizer=True)
    wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
    return profile_to_dict(profile), before, len(live_groups()), wall, cpu
