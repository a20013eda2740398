"""decode_gemv: the Pallas kernel (interpret mode on CPU) vs its jnp reference, and the reference vs
a float64 numpy loop over rows and output columns.

In bf16 the kernel and the reference round the product (and each epilogue op) the same way but
may sum K in another order, so they agree to within a couple of ulps; in f32 to float rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_gemv import MAX_ROWS, accepts, decode_gemv, decode_gemv_reference

on_gpu = jax.default_backend() == "gpu"
EPS = 1e-6


def make_case(*, rows, K, N, L=3, dtype=jnp.bfloat16, seed=0, residual_width=None):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, K)).astype(np.float32)
    stack = (rng.standard_normal((L, K, N)) / np.sqrt(K)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, (L, K)).astype(np.float32)
    residual = rng.standard_normal((rows, residual_width or N)).astype(np.float32)
    return tuple(jnp.asarray(a, dtype) for a in (x, stack, norm, residual))


def numpy_loop(x, stack, layer, norm=None, activation=None, residual=None):
    """Row by row, output column by column, in float64."""
    x, w = np.asarray(x, np.float64), np.asarray(stack, np.float64)[layer]
    rows, n = x.shape[0], w.shape[1]
    n_out = n // 2 if activation else n
    out = np.zeros((rows, n_out))
    for m in range(rows):
        xm = x[m]
        if norm is not None:
            xm = np.asarray(norm[0], np.float64)[layer] * xm / np.sqrt(np.mean(xm * xm) + norm[1])
        for j in range(n_out):
            y = float(xm @ w[:, j])
            if activation == "silu_mul":
                y = y / (1 + np.exp(-y)) * float(xm @ w[:, n_out + j])
            out[m, j] = y + (float(np.asarray(residual, np.float64)[m, j]) if residual is not None else 0.0)
    return out


def run_both(case, layer, *, norm, activation, residual, **tuning):
    x, stack, norm_w, res = case
    kw = dict(norm=(norm_w, EPS) if norm else None, activation=activation, residual=res if residual else None)
    got = decode_gemv(x, stack, layer, interpret=not on_gpu, **kw, **tuning)
    return got, decode_gemv_reference(x, stack, layer, **kw), kw


def ulps_apart(a, b, dtype):
    """Max distance in units of `dtype`'s last place, at each reference value's magnitude or the
    values' typical one, whichever is larger (a residual add may cancel to a value whose own ulp is
    smaller than its operands')."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    eps = float(jnp.finfo(dtype).eps)
    return float(np.max(np.abs(a - b) / (np.maximum(np.abs(b), np.mean(np.abs(b))) * eps)))


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("norm,activation,residual", [(False, None, False), (True, None, False),
                                                     (True, "silu_mul", False), (False, None, True)])
def test_kernel_matches_reference_and_numpy(rows, norm, activation, residual):
    n = 96
    case = make_case(rows=rows, K=80, N=n, residual_width=n // 2 if activation else n, dtype=jnp.float32)
    got, want, kw = run_both(case, 2, norm=norm, activation=activation, residual=residual, block_k=32, block_n=16)
    assert got.shape == want.shape == (rows, n // 2 if activation else n)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(want), numpy_loop(case[0], case[1], 2, **kw), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("rows", [1, 5])
def test_bf16_within_rounding(rows):
    case = make_case(rows=rows, K=128, N=64, residual_width=32)
    got, want, _ = run_both(case, 1, norm=True, activation="silu_mul", residual=True, block_k=64, block_n=32)
    assert got.dtype == jnp.bfloat16
    assert ulps_apart(got, want, jnp.bfloat16) <= 4


def test_layer_is_read_in_place_and_may_be_traced():
    case = make_case(rows=2, K=64, N=32, dtype=jnp.float32)
    fn = jax.jit(lambda layer: decode_gemv(case[0], case[1], layer, interpret=not on_gpu, block_k=32, block_n=16))
    for layer in range(3):
        np.testing.assert_allclose(np.asarray(fn(jnp.int32(layer))), np.asarray(case[0] @ case[1][layer]),
                                   rtol=2e-5, atol=2e-5)


def test_refuses_what_it_cannot_take():
    x, stack, norm_w, _ = make_case(rows=2, K=64, N=32, dtype=jnp.float32)
    with pytest.raises(ValueError, match="expected x"):
        decode_gemv(jnp.zeros((MAX_ROWS + 1, 64)), stack, 0)
    with pytest.raises(ValueError, match="expected x"):
        decode_gemv(x[:, :48], stack, 0)
    with pytest.raises(ValueError, match="activation"):
        decode_gemv(x, stack, 0, activation="gelu")
    with pytest.raises(ValueError, match="residual"):
        decode_gemv(x, stack, 0, residual=jnp.zeros((2, 31)))
    with pytest.raises(ValueError, match="norm weights"):
        decode_gemv(x, stack, 0, norm=(norm_w[:, :10], EPS))
    assert not accepts(x.astype(jnp.bfloat16), stack)  # mixed dtypes go to XLA's dot


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu, reason="needs a GPU")
@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize("op", ["qkv", "o", "gate_up", "down"])
def test_qwen3_sizes_on_gpu(op, rows):
    k, n, kw = {"qkv": (1024, 4096, dict(norm=True)), "o": (2048, 1024, dict(residual=True)),
                "gate_up": (1024, 6144, dict(norm=True, activation="silu_mul")),
                "down": (3072, 1024, dict(residual=True))}[op]
    case = make_case(rows=rows, K=k, N=n, L=2, residual_width=n // 2 if kw.get("activation") else n)
    got, want, _ = run_both(case, 1, norm=kw.get("norm", False), activation=kw.get("activation"),
                            residual=kw.get("residual", False))
    assert ulps_apart(got, want, jnp.bfloat16) <= 4
