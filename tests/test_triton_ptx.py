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


@pytest.mark.parametrize(("num_stages", "ring"), [(2, 1), (3, 2), (4, 3)])
def test_the_attention_kernel_keeps_num_stages_minus_one_chunks_in_flight(num_stages, ring):
    """ragged_paged_attention compiled for sm_90 (where `triton` is installed): the K and V tiles of its
    unmasked loop each get a ring of num_stages - 1 shared-memory buffers. With the block table read in
    the same iteration as the K/V loads, Triton's pipeliner kept one buffer at any num_stages."""
    pytest.importorskip("triton")
    import functools
    import re

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    R, ctx, Hq, Hkv, D, bs = 8, 512, 16, 8, 128, 16
    blocks = R * ctx // bs + 4
    S, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    args = (S((R, Hq, D), bf16), S((1, blocks, Hkv, bs, D), bf16), S((1, blocks, Hkv, bs, D), bf16), S((), i32),
            S((R, ctx // bs), i32), S((R,), i32), S((R + 1,), i32), S((), i32))
    fn = functools.partial(ragged_paged_attention, sm_scale=D**-0.5, block_m=16, block_n=64, num_kv_splits=1,
                           num_warps=4, num_stages=num_stages)
    script = load_script()
    (module,) = script.triton_modules(fn, *args)
    ttgir = script.compile_module(module, num_warps=4, num_stages=num_stages).asm["ttgir"]
    rings = re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x64x128xbf16", ttgir)
    assert rings[:2] == [str(ring)] * 2, rings  # K's ring, then V's: the unmasked loop's, first in the kernel
