"""Fixtures of the kernel tests."""

import pytest

from tests.triton_lowering import verify_triton_lowering


@pytest.fixture
def triton_lowering_without_a_gpu(monkeypatch):
    """Pallas's Triton lowering (a kernel as Triton IR; PTX comes later, on a GPU) on a machine without
    one (tests/triton_lowering.py); after the test, every module it built must have lowered and verified."""
    verified = verify_triton_lowering(monkeypatch)
    yield verified
    assert verified and all(verified), verified
