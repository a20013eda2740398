"""skinny_matmul (the split-K weight-streaming GEMM on Mosaic GPU): in Mosaic GPU's interpreter on
the CPU against the jnp reference and an f32 product; its default configs at Qwen3-0.6B's shapes
lowered for CUDA (the interpreter runs tilings the real lowering refuses); bad input refused; on a
GPU (`-m gpu`) the real kernel against the reference at the real shapes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import skinny_gemm_mgpu as sk
from pallas_kernels.skinny_gemm_mgpu import SkinnyConfig, default_config, skinny_matmul, skinny_matmul_reference

on_gpu = jax.default_backend() == "gpu"
# Qwen3-0.6B's projections, [K, N]: qkv, o, gate_up, down, the LM head (the tied embedding).
QWEN3_06B = {"qkv_proj": (1024, 4096), "o_proj": (2048, 1024), "gate_up_proj": (1024, 6144),
             "down_proj": (3072, 1024), "lm_head": (1024, 151936)}


def make(m, k, n, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * 0.05).astype(jnp.bfloat16)
    return x, w


@functools.lru_cache(maxsize=None)
def jitted(config):
    return jax.jit(functools.partial(skinny_matmul, config=config, interpret=not on_gpu))


def check(x, w, config):
    """The kernel == the reference to a bf16 rounding step (the split sums round in another order),
    and both == the f32 product within bf16's precision; the f32 partials == the f32 product closely."""
    m = x.shape[0]
    y = np.asarray(jitted(config)(x, w), np.float32)
    ref = np.asarray(jax.jit(skinny_matmul_reference)(x, w), np.float32)
    exact = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    assert y.shape == (m, w.shape[1])
    np.testing.assert_allclose(y, ref, rtol=2**-7, atol=1e-3)
    np.testing.assert_allclose(y, exact, rtol=2**-7, atol=1e-2)
    # The partials before the bf16 cast: f32 sums, so only the summation order differs; the
    # padding rows (zero rows of x) stay zero.
    config = config or default_config(m, *w.shape)
    mpad = sk.padded_rows(m)
    x_padded = jnp.pad(x, ((0, mpad - m), (0, 0)))
    partials = np.asarray(jax.jit(functools.partial(sk.skinny_partials, config=config, interpret=not on_gpu))(
        x_padded, w))
    assert partials.shape == (config.splits, w.shape[1], mpad)
    # One split stores the bf16 product itself; more store f32 partials.
    single = config.splits == 1
    assert partials.dtype == (jnp.bfloat16 if single else np.float32)
    tol = 2**-7 if single else 1e-3
    np.testing.assert_allclose(partials.astype(np.float32).sum(0)[:, :m].T, exact, rtol=tol, atol=tol)
    assert not partials[:, :, m:].astype(np.float32).any()


# (K, N, config): K split in 2 with one stage per step; 8 steps through a ring of 3 stages with
# 128-wide tiles; the default rule (which splits this K in 4 or 2 by the rows).
CASES = {"split2": (256, 128, SkinnyConfig(tile_n=64, tile_k=64, splits=2, max_concurrent_steps=2)),
         "ring3_tn128": (512, 256, SkinnyConfig(tile_n=128, tile_k=64, splits=1, max_concurrent_steps=3)),
         "default": (256, 128, None)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("m", [1, 5, 8, 32])
def test_interpreted_kernel_matches_reference(m, case):
    k, n, config = CASES[case]
    x, w = make(m, k, n, seed=m)
    check(x, w, config)


@pytest.mark.parametrize("traced", [False, True])
def test_stacked_weight_reads_the_given_layer(traced):
    """A [L, K, N] stack with layer= gives x @ w[layer] for every layer, the layer a Python int or a
    traced scalar (a scan's index): each layer's product against the reference on that layer alone."""
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (5, 256), jnp.bfloat16)
    stack = (jax.random.normal(kw, (3, 256, 128), jnp.float32) * 0.05).astype(jnp.bfloat16)
    config = SkinnyConfig(tile_n=64, tile_k=64, splits=2, max_concurrent_steps=2)
    run = functools.partial(skinny_matmul, config=config, interpret=not on_gpu)
    for layer in range(3):
        if traced:
            y = jax.jit(lambda x, w, j: run(x, w, layer=j))(x, stack, jnp.int32(layer))
        else:
            y = run(x, stack, layer=layer)
        ref = skinny_matmul_reference(x, stack[layer])
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32), rtol=2**-7, atol=1e-3)


def test_interpreter_finds_no_race_in_the_pipeline():
    """Mosaic GPU's interpreter with its race detector: the TMA ring (8 steps through 3 stages) and
    the partials' store race with nothing. (It runs wgmma synchronously, so it cannot see a stage
    refilled while a wgmma still reads it: wgmma_wait(1) before the refill guards that.)"""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # the detector's state is private

    x, w = make(8, 1024, 256)
    config = SkinnyConfig(tile_n=128, tile_k=64, splits=2, max_concurrent_steps=3)
    params = plgpu.InterpretGPUParams(detect_races=True)
    y = jax.block_until_ready(skinny_matmul(x, w, config=config, interpret=params))
    assert not gpu_callbacks.get_races().races_found
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(skinny_matmul_reference(x, w), np.float32),
                               rtol=2**-7, atol=1e-3)


def test_default_config_rule_at_small_shapes():
    """The rule splits K for a narrow output and keeps at least 4 * mpad of K per split."""
    assert default_config(1, 256, 128, num_sms=132) == SkinnyConfig(64, 64, 4, 1)
    assert default_config(32, 256, 128, num_sms=132) == SkinnyConfig(64, 64, 2, 2)
    assert default_config(8, 128, 256, num_sms=132, tile_k=128) == SkinnyConfig(64, 128, 1, 1)
    assert default_config(1, 256, 128, num_sms=132, splits=1) == SkinnyConfig(64, 64, 1, 4)


# The default configs at Qwen3-0.6B's shapes on 132 SMs: (tile_n, splits) and the CTAs they make.
# At 32 rows the partials' cap halves o_proj's splits.
EXPECTED = {(1, "qkv_proj"): (64, 8, 512), (1, "o_proj"): (64, 32, 512), (1, "gate_up_proj"): (64, 4, 384),
            (1, "down_proj"): (64, 24, 384), (1, "lm_head"): (128, 1, 1187),
            (32, "qkv_proj"): (64, 8, 512), (32, "o_proj"): (64, 16, 256), (32, "gate_up_proj"): (64, 4, 384),
            (32, "down_proj"): (64, 24, 384), (32, "lm_head"): (128, 1, 1187)}


@pytest.mark.parametrize("m", [1, 32])
def test_default_configs_at_qwen3_shapes(m):
    for name, (k, n) in QWEN3_06B.items():
        c = default_config(m, k, n, num_sms=132)
        assert (c.tile_n, c.splits, n // c.tile_n * c.splits) == EXPECTED[m, name], name
        assert c.tile_k == 64 and c.max_concurrent_steps == min(4, k // 64 // c.splits)


@pytest.mark.parametrize("m", [1, 5, 8, 16, 32])
def test_cuda_lowering_accepts_default_configs_at_qwen3_shapes(m, monkeypatch):
    """The real Mosaic GPU lowering (layouts, swizzles, wgmma shapes, shared memory size) takes the
    default config of every projection, lowered for CUDA on any backend with the H200's SM count."""
    monkeypatch.setattr(sk, "device_sm_count", lambda: 132)
    for name, (k, n) in QWEN3_06B.items():
        x, w = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
        jax.jit(skinny_matmul).trace(x, w).lower(lowering_platforms=("cuda",))


def test_cuda_lowering_accepts_a_stacked_weight_with_a_traced_layer(monkeypatch):
    """The stack read in place at a traced layer (the engine's layer loop) lowers for CUDA."""
    monkeypatch.setattr(sk, "device_sm_count", lambda: 132)
    k, n = QWEN3_06B["o_proj"]
    x, w = jax.ShapeDtypeStruct((1, k), jnp.bfloat16), jax.ShapeDtypeStruct((28, k, n), jnp.bfloat16)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    jax.jit(lambda x, w, j: skinny_matmul(x, w, layer=j)).trace(x, w, layer).lower(lowering_platforms=("cuda",))


def test_cuda_lowering_refuses_too_much_shared_memory():
    """Lowering checks the stages fit in shared memory (so the test above checks that too)."""
    x, w = jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16)
    config = SkinnyConfig(tile_n=256, tile_k=256, splits=2, max_concurrent_steps=4)
    with pytest.raises(ValueError, match="shared memory"):
        jax.jit(functools.partial(skinny_matmul, config=config)).trace(x, w).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize(("x_shape", "w_shape", "dtypes", "config", "match"), [
    ((33, 128), (128, 128), None, None, "M = 33 rows"),
    ((0, 128), (128, 128), None, None, "M = 0 rows"),
    ((4, 100), (100, 128), None, None, "K = 100 is not divisible by tile_k = 64"),
    ((4, 128), (128, 96), None, None, "N = 96 is not divisible by tile_n = 64"),
    ((4, 256), (256, 128), None, SkinnyConfig(64, 64, 3, 2), "splits = 3 must divide K / tile_k = 4"),
    ((4, 128), (128, 128), None, SkinnyConfig(32, 64, 1, 2), "tile_n = 32 must be a positive multiple of 64"),
    ((4, 128), (128, 128), None, SkinnyConfig(64, 8, 1, 2), "tile_k = 8 must be a positive multiple of 16"),
    ((4, 128), (128, 128), None, SkinnyConfig(64, 64, 1, 0), "max_concurrent_steps = 0"),
    ((4, 128), (64, 128), None, None, "x's K = 128 differs from w's K = 64"),
    ((4, 128), (128, 128), (jnp.float32, jnp.bfloat16), None, "must be bfloat16, got x float32"),
    ((4, 128), (128, 128), (jnp.bfloat16, jnp.float16), None, "must be bfloat16, got x bfloat16 and w float16"),
    ((128,), (128, 128), None, None, "x must be \\[M, K\\]"),
    ((4, 128), (2, 128, 128), None, None, "needs layer="),
])
def test_bad_input_raises(x_shape, w_shape, dtypes, config, match):
    xd, wd = dtypes or (jnp.bfloat16, jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        skinny_matmul(jnp.zeros(x_shape, xd), jnp.zeros(w_shape, wd), config=config, interpret=True)


def test_accepts_names_the_inputs_the_default_config_takes():
    """`accepts` says yes exactly where skinny_matmul with its default config does not raise."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    cases = {((32, 128), (128, 128), bf16): True, ((33, 128), (128, 128), bf16): False,
             ((4, 96), (96, 128), bf16): False, ((4, 128), (128, 96), bf16): False,
             ((4, 128), (128, 128), f32): False, ((128,), (128, 128), bf16): False}
    for (x_shape, w_shape, dtype), ok in cases.items():
        x, w = jax.ShapeDtypeStruct(x_shape, dtype), jax.ShapeDtypeStruct(w_shape, dtype)
        assert sk.accepts(x, w) is ok, (x_shape, w_shape, dtype)
        if not ok:
            with pytest.raises(ValueError):
                skinny_matmul(jnp.zeros(x_shape, dtype), jnp.zeros(w_shape, dtype), interpret=True)


@pytest.mark.parametrize(("w_shape", "layer", "match"), [
    ((128, 128), 0, "takes none"), ((2, 128, 128), 2, "layer = 2 is outside the stack's 2 layers"),
    ((2, 128, 128), -1, "layer = -1 is outside")])
def test_bad_layer_raises(w_shape, layer, match):
    with pytest.raises(ValueError, match=match):
        skinny_matmul(jnp.zeros((4, 128), jnp.bfloat16), jnp.zeros(w_shape, jnp.bfloat16), layer=layer,
                      interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 8, 32])
def test_gpu_qwen3_shapes_match_reference(m):
    """The real kernel on the GPU, default configs, every Qwen3-0.6B projection."""
    for name, (k, n) in QWEN3_06B.items():
        x, w = make(m, k, n, seed=m)
        check(x, w, None)
