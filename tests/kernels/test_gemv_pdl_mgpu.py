"""gemv_pdl_mgpu (the one-row projection on Mosaic GPU that stages its weights before waiting on the kernel
before it): in Mosaic GPU's interpreter on the CPU against gemv_triton's jnp reference and a numpy f64
computation of the layer's math, with its race detector on; every projection of a Qwen3-0.6B layer lowered
for CUDA, with the PDL launch and its grid-dependency instructions present exactly when asked for; bad
input refused; on a GPU (`-m gpu`) the real kernel, with and without PDL, against the reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gemv_pdl_mgpu import CHUNK, GemvPdlConfig, gemv
from pallas_kernels.gemv_triton import gemv_reference
from tests.kernels.test_gemv_triton import QWEN3_06B, assert_refused, make, numpy_layer_math

on_gpu = jax.default_backend() == "gpu"


def run(x, w, layer, g, r, *, norm, epilogue, config=None, interpret=not on_gpu):
    fn = functools.partial(gemv, epilogue=epilogue, config=config, interpret=interpret)
    return jax.jit(lambda x, w, layer, g, r: fn(x, w, layer=layer, norm_weight=g if norm else None,
                                                  residual=r if epilogue == "residual" else None))(x, w, layer, g, r)


def reference(x, w, layer, g, r, *, norm, epilogue):
    return np.asarray(gemv_reference(x, w, layer=layer, norm_weight=g if norm else None, epilogue=epilogue,
                                     residual=r if epilogue == "residual" else None), np.float32)


@pytest.mark.parametrize("norm,epilogue,block_n,chunks", [
    (False, None, 8, 1), (True, None, 16, 2), (False, "residual", 8, 3), (True, "residual", 16, 2),
    (True, "swiglu", 8, 2), (True, "swiglu", 16, 1)])
def test_every_variant_matches_the_reference_and_the_layer_math(norm, epilogue, block_n, chunks):
    """Each epilogue, with and without the norm, K in one 256-wide chunk or several, several CTAs (with
    SwiGLU each pairs its gate rows with the up rows N / 2 further)."""
    x, w, g, r = make(3, chunks * CHUNK, 64)
    y = np.asarray(run(x, w, 2, g, r, norm=norm, epilogue=epilogue, config=GemvPdlConfig(block_n=block_n)),
                   np.float32)
    ref = reference(x, w, 2, g, r, norm=norm, epilogue=epilogue)
    exact = numpy_layer_math(x, w[2], g[2], r, norm=norm, epilogue=epilogue)
    assert y.shape == ref.shape == exact.shape == (1, 32 if epilogue == "swiglu" else 64)
    np.testing.assert_allclose(y, ref, rtol=2**-7, atol=2e-2)
    np.testing.assert_allclose(y, exact, rtol=2**-6, atol=3e-2)


def test_no_races_in_the_interpreter():
    """The race detector over the staged weight chunks, x, the norm weight and the residual arriving on
    their own barriers, and the outputs written to shared memory before their TMA store."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # the detector's state is private
    from jax.experimental.pallas import mosaic_gpu as plgpu

    x, w, g, r = make(2, 3 * CHUNK, 32, seed=3)
    y = gemv(x, w, layer=1, norm_weight=g, epilogue="residual", residual=r, config=GemvPdlConfig(block_n=16),
             interpret=plgpu.InterpretGPUParams(detect_races=True))
    jax.block_until_ready(y)
    assert not gpu_callbacks.get_races().races_found
    np.testing.assert_allclose(np.asarray(y, np.float32), reference(x, w, 1, g, r, norm=True, epilogue="residual"),
                               rtol=2**-7, atol=3e-2)


def test_a_single_weight():
    """An unstacked [N, K] weight (no layer)."""
    x, w, _, _ = make(1, 2 * CHUNK, 32, seed=1)
    y = gemv(x, w[0], config=GemvPdlConfig(block_n=8), interpret=not on_gpu)
    exact = np.asarray(x, np.float64) @ np.asarray(w[0], np.float64).T
    np.testing.assert_allclose(np.asarray(y, np.float32), exact, rtol=2**-7, atol=2e-2)


def lowered_text(name, pdl):
    k, n, norm, epilogue = QWEN3_06B[name]
    S = jax.ShapeDtypeStruct
    fn = functools.partial(run, norm=norm, epilogue=epilogue, config=GemvPdlConfig(pdl=pdl), interpret=False)
    return jax.jit(fn).trace(S((1, k), jnp.bfloat16), S((28, n, k), jnp.bfloat16), S((), jnp.int32),
                             S((28, k), jnp.bfloat16), S((1, n), jnp.bfloat16)).lower(
                                 lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("name", list(QWEN3_06B))
def test_cuda_lowering_marks_the_pdl_launch_only_when_asked(name):
    """Mosaic GPU's layout inference and lowering take each projection with what surrounds it, from the 28
    stacked layers at a traced layer; with PDL the module asks for the programmatic launch and holds both
    grid-dependency instructions, without it neither."""
    with_pdl, without = lowered_text(name, True), lowered_text(name, False)
    assert "mosaic_gpu.uses_pdl" in with_pdl and "griddepcontrol.wait" in with_pdl
    assert "griddepcontrol.launch_dependents" in with_pdl
    assert "uses_pdl" not in without and "griddepcontrol" not in without


@pytest.mark.parametrize("kwargs,message", [
    (dict(x=(2, 512)), "one row"),
    (dict(k=320), "multiple of block_k"),
    (dict(config=GemvPdlConfig(block_n=4)), "multiple of 8"),
    (dict(config=GemvPdlConfig(block_n=24)), "power of two"),
    (dict(k=13 * CHUNK, config=GemvPdlConfig(block_n=32)), "shared memory"),
    (dict(epilogue="residual"), "residual= is needed"),
    (dict(stacked=False, layer=0), "needs layer="),
])
def test_bad_input_is_refused(kwargs, message):
    assert_refused(gemv, kwargs, message, rows=1, k=512)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("name", list(QWEN3_06B))
def test_on_the_gpu_at_qwen3_shapes(name, pdl):
    k, n, norm, epilogue = QWEN3_06B[name]
    x, w, g, r = make(4, k, n)
    y = np.asarray(run(x, w, 3, g, r, norm=norm, epilogue=epilogue, config=GemvPdlConfig(pdl=pdl)), np.float32)
    np.testing.assert_allclose(y, reference(x, w, 3, g, r, norm=norm, epilogue=epilogue), rtol=2**-6, atol=5e-2)
