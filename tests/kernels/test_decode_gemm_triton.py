"""decode_gemm (a projection of 16-64 rows on tensor cores, with RMSNorm before and a residual add or
SwiGLU after, on Triton): in Pallas's interpreter on the CPU against gemv_triton's jnp reference and a
numpy f64 computation of the layer's math; every projection of a Qwen3-0.6B layer lowered to Triton IR
at 32 rows; bad input refused; on a GPU (`-m gpu`) the real kernel against the reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_gemm_triton import DecodeGemmConfig, decode_gemm
from pallas_kernels.gemv_triton import gemv_reference
from tests.kernels.test_gemv_triton import QWEN3_06B, assert_refused, make, numpy_layer_math

on_gpu = jax.default_backend() == "gpu"


def run(x, w, layer, g, r, *, norm, epilogue, config=None, interpret=not on_gpu):
    fn = functools.partial(decode_gemm, epilogue=epilogue, config=config, interpret=interpret)
    return jax.jit(lambda x, w, layer, g, r: fn(x, w, layer=layer, norm_weight=g if norm else None,
                                                  residual=r if epilogue == "residual" else None))(x, w, layer, g, r)


@pytest.mark.parametrize("norm,epilogue,rows,block_n,block_k", [
    (False, None, 16, 16, 64), (True, None, 32, 32, 128), (False, "residual", 16, 32, 256),
    (True, "residual", 32, 16, 64), (True, "swiglu", 16, 16, 128), (True, "swiglu", 48, 16, 64),
    (True, "residual", 1, 16, 64), (True, "swiglu", 5, 16, 128), (False, "residual", 24, 32, 64)])
def test_every_variant_matches_the_reference_and_the_layer_math(norm, epilogue, rows, block_n, block_k):
    """Each epilogue, with and without the norm, K in one chunk or several, 1 to 48 rows (tiles of 16,
    32 and 64 rows, the rows past x's not stored)."""
    x, w, g, r = make(3, 256, 64, rows=rows)
    config = DecodeGemmConfig(block_n=block_n, block_k=block_k, num_stages=2)
    y = np.asarray(run(x, w, 2, g, r, norm=norm, epilogue=epilogue, config=config), np.float32)
    ref = np.asarray(gemv_reference(x, w, layer=2, norm_weight=g if norm else None, epilogue=epilogue,
                                    residual=r if epilogue == "residual" else None), np.float32)
    exact = numpy_layer_math(x, w[2], g[2], r, norm=norm, epilogue=epilogue)
    assert y.shape == ref.shape == exact.shape == (rows, 32 if epilogue == "swiglu" else 64)
    np.testing.assert_allclose(y, ref, rtol=2**-7, atol=2e-2)
    np.testing.assert_allclose(y, exact, rtol=2**-6, atol=3e-2)


@pytest.mark.parametrize("name,rows", [(name, 32) for name in QWEN3_06B] + [("down_proj", 6), ("qkv_proj", 40)])
def test_each_projection_of_a_layer_lowers_to_triton(triton_lowering_without_a_gpu, name, rows):
    """Pallas's Triton lowering takes each projection with what surrounds it at 32 rows, and at row
    counts short of their tile (masked stores), from the 28 stacked layers at a traced layer."""
    k, n, norm, epilogue = QWEN3_06B[name]
    S = jax.ShapeDtypeStruct
    fn = functools.partial(run, norm=norm, epilogue=epilogue, config=DecodeGemmConfig(), interpret=False)
    jax.jit(fn).trace(S((rows, k), jnp.bfloat16), S((28, n, k), jnp.bfloat16), S((), jnp.int32),
                      S((28, k), jnp.bfloat16), S((rows, n), jnp.bfloat16)).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("kwargs,message", [
    (dict(x=(80, 256)), "1 <= R <= 64"),
    (dict(k=320), "multiple of block_k"),
    (dict(n=40), "block_n"),
    (dict(config=DecodeGemmConfig(block_n=8)), "at least 16"),
    (dict(epilogue="residual"), "residual= is needed"),
    (dict(stacked=False, layer=0), "needs layer="),
])
def test_bad_input_is_refused(kwargs, message):
    assert_refused(decode_gemm, kwargs, message, rows=16, k=256)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(QWEN3_06B))
def test_on_the_gpu_at_qwen3_shapes(name):
    k, n, norm, epilogue = QWEN3_06B[name]
    x, w, g, r = make(4, k, n, rows=32)
    y = np.asarray(run(x, w, 3, g, r, norm=norm, epilogue=epilogue, config=DecodeGemmConfig()), np.float32)
    ref = np.asarray(gemv_reference(x, w, layer=3, norm_weight=g if norm else None, epilogue=epilogue,
                                    residual=r if epilogue == "residual" else None), np.float32)
    np.testing.assert_allclose(y, ref, rtol=2**-6, atol=5e-2)
