"""Every rank runs on the vendor its island declares: an NVIDIA island on CUDA, an AMD island on ROCm.

Before this check a host whose torch had no CUDA (a CPU wheel on a GPU node) trained its NVIDIA
island on the CPU, silently and hundreds of times slower than planned; a CUDA torch on an AMD node
ran RCCL's island on the wrong library. Stand-ins (CPUs for GPU islands in tests, demos and
emulation; one vendor's GPUs labelled as the other's in the bridge tests) are asked for explicitly:
by the cluster's ``emulation:`` block or ``--hetero-device-stand-in``.

``vendor_mismatch`` is pure (one rank); ``check_rank_devices`` gathers every rank's verdict so the
whole job stops with the same list on every rank, before any group is built.
"""

from __future__ import annotations

from megatron_het.cluster import ConfigError
from megatron_het.cluster.catalog import AMD, HOST, NVIDIA

__all__ = ["check_rank_devices", "vendor_mismatch"]

RUNTIME = {NVIDIA: "a CUDA build of torch and an NVIDIA GPU", AMD: "a ROCm build of torch and an AMD GPU"}


def vendor_mismatch(*, rank: int, island: str, device: str, vendor: str, accelerator_vendor: str,
                    device_name: str, stand_in: bool) -> str | None:
    """Why rank ``rank`` of island ``island`` (device type ``device`` of ``vendor``) cannot run on
    this process's accelerator, or None. Host (CPU) device types run anywhere; with ``stand_in``
    every process may run any island."""
    if vendor not in RUNTIME or accelerator_vendor == vendor or stand_in:
        return None
    here = (f"this process sees {device_name} ({accelerator_vendor})" if accelerator_vendor != HOST
            else "this process's torch sees no GPU (it would train on the CPU)")
    return f"rank {rank} is in island {island!r} ({device}, {vendor}) but {here}; it needs {RUNTIME[vendor]}"


def check_rank_devices(cluster, plan, accelerator, *, stand_in: bool) -> None:
    """Raise ConfigError on every rank when any rank's device is not its island's vendor (collective)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = None
    try:  # a local error is gathered too: a rank that raised alone would leave the others waiting
        island = next((name for name, ranks in plan.island_ranks().items() if rank in ranks), None)
        if island is not None:
            device = cluster.island(island).device
            mine = vendor_mismatch(rank=rank, island=island, device=device.name, vendor=device.vendor,
                                   accelerator_vendor=accelerator.vendor, device_name=accelerator.device_name,
                                   stand_in=stand_in)
    except (KeyError, ValueError) as e:
        mine = f"rank {rank}: its island could not be checked ({e})"
    verdicts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, mine)
    wrong = [v for v in verdicts if v is not None]
    if wrong:
        shown = "; ".join(wrong[:4]) + (f"; and {len(wrong) - 4} more" if len(wrong) > 4 else "")
        raise ConfigError(f"{len(wrong)} of {len(verdicts)} ranks run on another vendor than their island's: "
                          f"{shown}", field="cluster islands", value=cluster.source or "cluster",
                          fix="install the vendor's torch build on those nodes or correct the islands' device "
                              "types; to let these devices stand in on purpose (tests, demos), add an emulation: "
                              "block to the cluster file or pass --hetero-device-stand-in")
