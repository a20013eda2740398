"""Grouped GEMM kernel (interpret mode on CPU) against its ragged_dot reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_gemm import (
    default_block_m,
    dequantize_blocks,
    grouped_gemm,
    grouped_gemm_reference,
)

reference = jax.jit(grouped_gemm_reference, static_argnames="scale_block")


def _operands(sizes, k, n, extra_rows=0, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    m = int(sum(sizes)) + extra_rows
    # device_put of host-converted arrays: jnp.asarray would compile a conversion per shape.
    lhs = jax.device_put(rng.standard_normal((m, k)).astype(dtype))
    rhs = jax.device_put(rng.standard_normal((len(sizes), k, n)).astype(dtype))
    return lhs, rhs, jax.device_put(np.asarray(sizes, np.int32))


def _numpy_grouped(lhs, rhs, sizes):
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float64)
    off = 0
    for g, s in enumerate(sizes):
        out[off:off + s] = lhs[off:off + s] @ rhs[g]
        off += s
    return out


@pytest.mark.parametrize("sizes,k,n,extra", [
    ((5, 0, 17, 1, 0, 9), 24, 40, 0),      # ragged, empty groups, K and N not block multiples
    ((0, 0, 33), 16, 16, 0),               # all rows in the last group
    ((40,), 32, 48, 0),                    # one group, several row tiles
    ((3, 4), 20, 24, 7),                   # rows past sum(group_sizes) come out zero
    ((0, 0, 0), 16, 16, 5),                # no row in any group
])
def test_kernel_matches_reference_on_ragged_groups(sizes, k, n, extra):
    lhs, rhs, gs = _operands(sizes, k, n, extra)
    expected = _numpy_grouped(lhs, rhs, sizes)
    ref = reference(lhs, rhs, gs)
    np.testing.assert_allclose(np.asarray(ref), expected, rtol=1e-5, atol=1e-4)
    for block_m in (16, 32):
        out = grouped_gemm(lhs, rhs, gs, block_m=block_m, block_n=16, block_k=16, interpret=True)
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-4)


def test_kernel_bf16_inputs_accumulate_in_f32():
    lhs, rhs, gs = _operands((9, 0, 14), 64, 32, dtype=jnp.bfloat16)
    out = grouped_gemm(lhs, rhs, gs, block_m=16, block_n=16, block_k=32, interpret=True)
    assert out.dtype == jnp.bfloat16
    expected = _numpy_grouped(np.asarray(lhs, np.float32), np.asarray(rhs, np.float32), (9, 0, 14))
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=2e-2, atol=5e-2)


def test_kernel_fp8_weights_with_block_scales():
    """FP8 rhs + per-(32x32 block) scales: dequantised inside the kernel."""
    rng = np.random.default_rng(3)
    sizes, k, n, sb = (6, 0, 11), 64, 64, 32
    lhs = jax.device_put(rng.standard_normal((sum(sizes), k)).astype(np.float32))
    w8 = jax.device_put(rng.standard_normal((3, k, n)).astype(jnp.float8_e4m3fn))
    scale = jax.device_put(rng.uniform(0.01, 0.1, (3, k // sb, n // sb)).astype(np.float32))
    gs = jax.device_put(np.asarray(sizes, np.int32))
    expected = _numpy_grouped(lhs, jax.jit(functools.partial(dequantize_blocks, scale_block=sb))(w8, scale), sizes)
    out = grouped_gemm(lhs, w8, gs, scale, scale_block=sb, block_m=16, block_n=16, block_k=16,
                       interpret=True)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-4)
    ref = reference(lhs, w8, gs, scale, scale_block=sb)
    np.testing.assert_allclose(np.asarray(ref), expected, rtol=1e-5, atol=1e-4)


def test_default_block_m_follows_mean_group_size():
    assert default_block_m(2048, 128) == 16
    assert default_block_m(32768, 128) == 128
    assert default_block_m(8 * 4096 // 64, 128) == 16


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [256, 4096])
def test_kernel_on_gpu_qwen3_moe_shapes(tokens):
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng(0)
    e, top_k, h, i = 128, 8, 2048, 768
    ids = rng.integers(0, e, tokens * top_k)
    sizes = np.bincount(ids, minlength=e)
    lhs = jnp.asarray(rng.standard_normal((tokens * top_k, h)), jnp.bfloat16)
    rhs = jnp.asarray(0.02 * rng.standard_normal((e, h, 2 * i)), jnp.bfloat16)
    out = grouped_gemm(lhs, rhs, jnp.asarray(sizes, jnp.int32))
    ref = grouped_gemm_reference(lhs, rhs, jnp.asarray(sizes, jnp.int32))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)
