"""benchmarks.gemv_layouts: its GEMVs over the [N, K] layout (Triton, Mosaic GPU) compute the products of
XLA's dot over [K, N] (interpreters, tiny shapes), and lower for CUDA at Qwen3-0.6B's shapes."""

import functools

import jax
import jax.numpy as jnp
import pytest

from benchmarks import gemv_layouts
from tests.triton_lowering import verify_triton_lowering


def test_every_way_matches_xla_s_product():
    results = gemv_layouts.main(["--tiny", "--rows", "1", "5", "--runs", "1", "--warmup", "0", "--max-configs", "1"])
    ways = {r["way"].split()[0] for r in results}
    assert ways == {"xla_kn", "xla_nk", "tdot_nk", "tfma_nk", "mfma_nk"}
    assert all("error" not in r and r["max_abs_error"] <= 0.02 for r in results), results


def test_kernels_lower_for_cuda(monkeypatch):
    verified = verify_triton_lowering(monkeypatch)
    S = jax.ShapeDtypeStruct
    configs = gemv_layouts.CONFIGS
    for rows, fma, (bn, bk, warps, stages) in ((8, False, configs["tdot_nk"][0]), (1, True, configs["tfma_nk"][0])):
        fn = functools.partial(gemv_layouts.gemv_nk, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                               fma=fma, interpret=False)
        jax.jit(fn).trace(S((rows, 3072), jnp.bfloat16), S((28, 1024, 3072), jnp.bfloat16), S((), jnp.int32)).lower(
            lowering_platforms=("cuda",))
    assert verified == [True, True]


def test_mosaic_gpu_kernel_lowers_for_cuda_at_every_projection():
    """Mosaic GPU's layout inference and lowering (TMA boxes, the strided register layout, the
    warpgroup sums) take every config at every Qwen3-0.6B projection, from the stacked layers."""
    S = jax.ShapeDtypeStruct
    for k, n in gemv_layouts.SHAPES.values():
        for bn, bk, warps, stages in gemv_layouts.CONFIGS["mfma_nk"]:
            fn = functools.partial(gemv_layouts.gemv_nk_mgpu, block_n=bn, num_stages=stages, interpret=False)
            jax.jit(fn).trace(S((1, k), jnp.bfloat16), S((28, n, k), jnp.bfloat16), S((), jnp.int32)).lower(
                lowering_platforms=("cuda",))


def test_mosaic_gpu_kernel_refuses_what_it_cannot_tile():
    x, w = jnp.zeros((2, 256), jnp.bfloat16), jnp.zeros((1, 64, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="rows=2"):
        gemv_layouts.gemv_nk_mgpu(x, w, 0, block_n=8, num_stages=2, interpret=True)
    with pytest.raises(ValueError, match="K=128"):
        gemv_layouts.gemv_nk_mgpu(x[:1, :128], w[:, :, :128], 0, block_n=8, num_stages=2, interpret=True)
