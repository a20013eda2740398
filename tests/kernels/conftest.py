"""Fixtures of the kernel tests."""

import pytest


@pytest.fixture
def triton_lowering_without_a_gpu(monkeypatch):
    """Pallas's Triton lowering (a kernel as Triton IR; PTX comes later, on a GPU) on a machine without
    one: Pallas asks the device for its compute capability, and an H100's is given instead."""
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100))
