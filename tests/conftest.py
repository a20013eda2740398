"""Shared test setup: CPU by default; `-m gpu` tests need a GPU, `-m oracle` tests need torch."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("MRV2_STRICT_COMPILES", "1")  # any compile inside an engine step fails

FIXTURES = Path(__file__).parent / "fixtures"


def pytest_collection_modifyitems(config, items):
    import jax

    on_gpu = jax.default_backend() == "gpu"
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a GPU (run on the accelerator machine)"))


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES
