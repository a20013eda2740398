"""scripts/triton_ptx.py without a GPU: it collects the Triton module of each Pallas Triton kernel a jitted
function lowers to (text without locations, one per kernel), leaves jax's Triton registration as it found
it, and says how to install `triton` when the package is missing. (Compiling a module to PTX needs the
`triton` wheel, not a project dependency; docs/benchmarks.md, session 51, has figures it gave.)"""

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.gemv_triton import GemvConfig, gemv

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "triton_ptx.py"


def load_script():
    spec = importlib.util.spec_from_file_location("triton_ptx", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_kernel_s_triton_module_is_collected_without_locations():
    from jax._src.pallas.triton import pallas_call_registration as registration

    script = load_script()
    before = registration.gpu_info_lib, registration.lowering.lower_jaxpr_to_triton_module
    S, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    config = GemvConfig(block_n=4, block_k=256, num_warps=4)

    def two_projections(x, w):
        h = gemv(x, w, layer=0, config=config)
        return gemv(h[:, :512], w, layer=1, config=config, epilogue="residual", residual=h)

    modules = script.triton_modules(two_projections, S((1, 512), bf16), S((2, 512, 512), bf16))
    assert len(modules) == 2
    for module in modules:
        assert "tt.func" in module and "tt.load" in module and "tt.store" in module
        assert "loc(" not in module and "#loc" not in module
    assert "tensor<4x256xbf16>" in modules[0]  # the [block_n, block_k] weight tile
    assert (registration.gpu_info_lib, registration.lowering.lower_jaxpr_to_triton_module) == before


def test_a_missing_triton_package_is_named_with_its_install(monkeypatch):
    script = load_script()
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    with pytest.raises(SystemExit, match=r"pip install triton==3\.6\.0"):
        script.ptx_facts("module {}", num_warps=4)
