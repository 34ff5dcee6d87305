"""Plans of the dry-run tier (tests/dryrun) that are built in code rather than read from a fixture."""

from __future__ import annotations

from megatron_het.plan import Plan, ReplicaPlan, StagePlan

A_COUNT, B_COUNT = 48, 32  # replicas of each layout of ``uneven_plan``
NV_RANKS = 2 * (A_COUNT + B_COUNT)  # nv ranks first, then amd


def uneven_plan() -> Plan:
    """480 ranks: 48 replicas of [nv TP=2 | amd TP=4] and 32 of [amd TP=4 as a 2x2x1 AxoNN grid | nv TP=2],
    each island's ranks handed out in replica order (a replica's stages sit far apart)."""
    nv, amd = iter(range(NV_RANKS)), iter(range(NV_RANKS, NV_RANKS + 4 * (A_COUNT + B_COUNT)))

    def stage(island, tp, layers, grid=None):
        ranks = tuple(next(nv if island == "nv" else amd) for _ in range(tp))
        return StagePlan(island=island, device_type="A100-80GB" if island == "nv" else "MI250X", ranks=ranks,
                         layers=layers, tp_grid=grid)

    reps = [ReplicaPlan(stages=(stage("nv", 2, (0, 10)), stage("amd", 4, (10, 32))), num_micro_batches=4)
            for _ in range(A_COUNT)]
    reps += [ReplicaPlan(stages=(stage("amd", 4, (0, 16), (2, 2, 1)), stage("nv", 2, (16, 32))),
                         num_micro_batches=4) for _ in range(B_COUNT)]
    return Plan(replicas=tuple(reps), micro_batch_size=1, global_batch_size=4 * (A_COUNT + B_COUNT))
