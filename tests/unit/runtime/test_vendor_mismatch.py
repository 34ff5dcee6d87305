"""A rank runs on its island's vendor: an NVIDIA island on CUDA, an AMD island on ROCm; CPUs stand in
for GPUs only when asked (runtime/device_check.py, issue #36)."""

from __future__ import annotations

import pytest

from megatron_het.platform import Accelerator
from megatron_het.runtime.device_check import vendor_mismatch


def _verdict(vendor, kind, *, stand_in=False, device="A100-80GB", name="NVIDIA A100"):
    acc = Accelerator(kind=kind, device_count=0 if kind == "cpu" else 1, torch_backend="gloo", device_name=name)
    return vendor_mismatch(rank=5, island="nv", device=device, vendor=vendor, accelerator_vendor=acc.vendor,
                           device_name=name, stand_in=stand_in)


@pytest.mark.parametrize("vendor,kind", [("nvidia", "cuda"), ("amd", "rocm"), ("cpu", "cpu"), ("cpu", "cuda")])
def test_a_rank_on_its_vendor_passes(vendor, kind):
    assert _verdict(vendor, kind) is None


def test_a_cpu_torch_on_an_nvidia_island_is_named():
    message = _verdict("nvidia", "cpu", name="cpu")
    assert message == ("rank 5 is in island 'nv' (A100-80GB, nvidia) but this process's torch sees no GPU (it "
                       "would train on the CPU); it needs a CUDA build of torch and an NVIDIA GPU")


def test_the_wrong_vendor_is_named():
    message = _verdict("amd", "cuda", device="MI250X", name="NVIDIA H100")
    assert message is not None and "'nv' (MI250X, amd)" in message and "sees NVIDIA H100 (nvidia)" in message
    assert "ROCm build" in message


def test_devices_stand_in_for_other_vendors_only_when_asked():
    assert _verdict("nvidia", "cpu", stand_in=True) is None
    assert _verdict("amd", "cuda", stand_in=True) is None
    assert _verdict("amd", "cpu", stand_in=False) is not None
