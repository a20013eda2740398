"""gemv (the GEMV of one row or a few over an [N, K] weight with RMSNorm before and a residual add or
SwiGLU after, on Triton): in Pallas's interpreter on the CPU against the jnp reference and a numpy f64 computation of
the layer's math; the fused gate/up against separate gate and up products; every projection of a
Qwen3-0.6B layer lowered to Triton IR; bad input refused; on a GPU (`-m gpu`) the real kernel against
the reference at the real shapes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gemv_triton import GemvConfig, gemv, gemv_reference

on_gpu = jax.default_backend() == "gpu"
# Qwen3-0.6B's decode projections as [N, K] with what surrounds each: (K, N, norm before, epilogue).
QWEN3_06B = {"qkv_proj": (1024, 4096, True, None), "o_proj": (2048, 1024, False, "residual"),
             "gate_up_proj": (1024, 6144, True, "swiglu"), "down_proj": (3072, 1024, False, "residual")}


def make(layers, k, n, seed=0, rows=1):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (layers, n, k), jnp.float32) * 0.05).astype(jnp.bfloat16)
    g = (1 + 0.2 * jax.random.normal(keys[2], (layers, k))).astype(jnp.bfloat16)
    r = jax.random.normal(keys[3], (rows, n), jnp.bfloat16)
    return x, w, g, r


def run(x, w, layer, g, r, *, norm, epilogue, config=None, interpret=not on_gpu):
    fn = functools.partial(gemv, epilogue=epilogue, config=config, interpret=interpret)
    return jax.jit(lambda x, w, layer, g, r: fn(x, w, layer=layer, norm_weight=g if norm else None,
                                                  residual=r if epilogue == "residual" else None))(x, w, layer, g, r)


def numpy_layer_math(x, w, g, r, *, norm, epilogue, eps=1e-6):
    """The same math in float64 numpy, written from the model's definition (no bf16 rounding)."""
    v = np.asarray(x, np.float64)
    if norm:
        v = v / np.sqrt((v * v).mean(axis=-1, keepdims=True) + eps) * np.asarray(g, np.float64)
    y = v @ np.asarray(w, np.float64).T
    if epilogue == "residual":
        return y + np.asarray(r, np.float64)
    if epilogue == "swiglu":
        gate, up = np.split(y, 2, axis=-1)
        return gate / (1 + np.exp(-gate)) * up
    return y


@pytest.mark.parametrize("norm,epilogue,block_n,block_k,rows", [
    (False, None, 4, 256, 1), (True, None, 8, 512, 1), (False, "residual", 4, 128, 1), (True, "residual", 16, 256, 1),
    (True, "swiglu", 4, 512, 1), (True, "swiglu", 8, 128, 1), (False, "residual", 1, 256, 1),
    (True, "residual", 2, 256, 3), (True, "swiglu", 4, 128, 8), (False, None, 1, 512, 5)])
def test_every_variant_matches_the_reference_and_the_layer_math(norm, epilogue, block_n, block_k, rows):
    """Each epilogue, with and without the norm, K in one chunk or several, one row of x or a few (each its
    own norm and its own residual row)."""
    x, w, g, r = make(3, 512, 64, rows=rows)
    config = GemvConfig(block_n=block_n, block_k=block_k, num_warps=4)
    y = np.asarray(run(x, w, 2, g, r, norm=norm, epilogue=epilogue, config=config), np.float32)
    ref = np.asarray(gemv_reference(x, w, layer=2, norm_weight=g if norm else None, epilogue=epilogue,
                                    residual=r if epilogue == "residual" else None), np.float32)
    exact = numpy_layer_math(x, w[2], g[2], r, norm=norm, epilogue=epilogue)
    assert y.shape == ref.shape == exact.shape == (rows, 32 if epilogue == "swiglu" else 64)
    np.testing.assert_allclose(y, ref, rtol=2**-7, atol=2e-2)
    np.testing.assert_allclose(y, exact, rtol=2**-6, atol=3e-2)


def test_a_single_weight():
    """An unstacked [N, K] weight."""
    x, w, _, _ = make(1, 768, 32, seed=1)
    y = gemv(x, w[0], config=GemvConfig(block_n=8, block_k=256), interpret=not on_gpu)
    exact = np.asarray(x, np.float64) @ np.asarray(w[0], np.float64).T
    np.testing.assert_allclose(np.asarray(y, np.float32), exact, rtol=2**-7, atol=2e-2)


def test_a_python_int_layer_is_compiled_in_and_gives_the_traced_layer_s_result():
    """layer=2 (a Python int, in the kernel) and layer=int32 2 (an operand the kernel reads) agree."""
    x, w, g, r = make(3, 512, 32, seed=4, rows=2)
    kwargs = dict(norm_weight=g, epilogue="residual", residual=r, config=GemvConfig(block_n=4, block_k=256),
                  interpret=not on_gpu)
    static = jax.jit(lambda x, w: gemv(x, w, layer=2, **kwargs))(x, w)
    traced = jax.jit(lambda x, w, layer: gemv(x, w, layer=layer, **kwargs))(x, w, jnp.int32(2))
    np.testing.assert_array_equal(np.asarray(static, np.float32), np.asarray(traced, np.float32))
    with pytest.raises(ValueError, match="outside the stack's 3 layers"):
        gemv(x, w, layer=3, **kwargs)


def test_fused_gate_up_gives_silu_of_gate_times_up():
    """The SwiGLU epilogue over gate's rows then up's == silu(x @ gate.T) * (x @ up.T) with separate
    weights, for more than one program (each pairs its gate rows with the up rows I rows further)."""
    keys = jax.random.split(jax.random.key(2), 3)
    k, inter = 256, 48
    x = jax.random.normal(keys[0], (1, k), jnp.bfloat16)
    gate = (jax.random.normal(keys[1], (2, inter, k), jnp.float32) * 0.05).astype(jnp.bfloat16)
    up = (jax.random.normal(keys[2], (2, inter, k), jnp.float32) * 0.05).astype(jnp.bfloat16)
    w = jnp.concatenate([gate, up], axis=1)
    y = gemv(x, w, layer=1, epilogue="swiglu", config=GemvConfig(block_n=8, block_k=128), interpret=not on_gpu)
    xf = np.asarray(x, np.float64)
    a, b = xf @ np.asarray(gate[1], np.float64).T, xf @ np.asarray(up[1], np.float64).T
    np.testing.assert_allclose(np.asarray(y, np.float32), a / (1 + np.exp(-a)) * b, rtol=2**-6, atol=2e-2)


@pytest.mark.parametrize("name", list(QWEN3_06B))
def test_each_projection_of_a_layer_lowers_to_triton(triton_lowering_without_a_gpu, name):
    """Pallas's Triton lowering takes each projection with what surrounds it, from the 28 stacked layers
    at a traced layer, at one row and at eight, for a few configs."""
    k, n, norm, epilogue = QWEN3_06B[name]
    S = jax.ShapeDtypeStruct
    for rows, config in ((1, GemvConfig()), (1, GemvConfig(block_n=16, block_k=256, num_warps=4)),
                         (8, GemvConfig(block_n=1, block_k=1024, num_warps=8))):
        fn = functools.partial(run, norm=norm, epilogue=epilogue, config=config, interpret=False)
        jax.jit(fn).trace(S((rows, k), jnp.bfloat16), S((28, n, k), jnp.bfloat16), S((), jnp.int32),
                          S((28, k), jnp.bfloat16), S((rows, n), jnp.bfloat16)).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("kwargs,message", [
    (dict(x=(33, 512)), "rows"),
    (dict(x=(0, 512)), "rows"),
    (dict(k=384), "multiple of block_k"),
    (dict(n=62), "block_n"),
    (dict(config=GemvConfig(block_n=12)), "power of two"),
    (dict(epilogue="residual"), "residual= is needed"),
    (dict(epilogue="gelu"), "epilogue must be"),
    (dict(stacked=False, layer=0), "needs layer="),
])
def test_bad_input_is_refused(kwargs, message):
    assert_refused(gemv, kwargs, message, rows=1, k=512)


def assert_refused(kernel, kwargs, message, *, rows, k):
    """`kernel` on zero inputs (x of `rows` rows, a 2-layer stack of [64, k]) with `kwargs`' overrides (x's
    shape, k, n, an unstacked weight with a layer, epilogue, config) raises a ValueError matching `message`."""
    k, n = kwargs.get("k", k), kwargs.get("n", 64)
    x = jnp.zeros(kwargs.get("x", (rows, k)), jnp.bfloat16)
    w = jnp.zeros((2, n, k) if kwargs.get("stacked", True) else (n, k), jnp.bfloat16)
    layer = kwargs.get("layer", 0 if kwargs.get("stacked", True) else None)
    with pytest.raises(ValueError, match=message):
        kernel(x, w, layer=layer, epilogue=kwargs.get("epilogue"), config=kwargs.get("config"), interpret=True)


def test_a_stack_too_large_for_int32_offsets_is_refused():
    """Qwen3-8B's 36 gate_up weights ([24576, 4096]) hold more than 2**31 elements: refused, not wrapped."""
    S = jax.ShapeDtypeStruct
    with pytest.raises(ValueError, match="int32 offsets"):
        jax.eval_shape(functools.partial(gemv, layer=0, epilogue="swiglu"), S((1, 4096), jnp.bfloat16),
                       S((36, 24576, 4096), jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("name", list(QWEN3_06B))
def test_on_the_gpu_at_qwen3_shapes(name, rows):
    k, n, norm, epilogue = QWEN3_06B[name]
    x, w, g, r = make(4, k, n, rows=rows)
    from mrv2_jax.models.gemv_projections import gemv_config  # the engine's config for the projection

    y = np.asarray(run(x, w, 3, g, r, norm=norm, epilogue=epilogue, config=gemv_config(n, k)), np.float32)
    ref = np.asarray(gemv_reference(x, w, layer=3, norm_weight=g if norm else None, epilogue=epilogue,
                                    residual=r if epilogue == "residual" else None), np.float32)
    # A few bf16 steps: the kernel scales the sums by the norm where the reference rounds the normed x,
    # and SwiGLU multiplies two such rounded products.
    np.testing.assert_allclose(y, ref, rtol=2**-6, atol=5e-2)
