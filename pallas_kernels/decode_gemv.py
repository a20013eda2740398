"""A decode projection with its neighbours, in one weight-streaming kernel (Pallas, Triton backend).

``decode_gemv(x, stack, layer)`` computes ``x @ stack[layer]`` for decode's few rows (``M <= 32``),
reading layer ``layer`` of a stacked ``[L, K, N]`` weight in place, and may take on the small
operations a decoder layer puts around its projections:

* ``norm=(weights [L, K], eps)``: RMSNorm of ``x``'s rows first (the layer's input norm; the stacked
  weights read in place too);
* ``activation="silu_mul"``: the weight is SwiGLU's fused ``[gate | up]`` (``N = 2 * I``) and the
  result ``silu(gate) * up`` (``[M, I]``);
* ``residual=[M, N]``: the result is ``residual + x @ w`` (o and down projections).

Why. At decode the projections stream their weights once per step for 1-32 rows, so they are
bound by memory; around them a layer runs the norms, SwiGLU's product and the residual adds as
kernels of their own, each a launch that moves a few kilobytes (docs/benchmarks.md, "Decode
projections as weight-streaming GEMVs"). Why the Triton backend: the rows (1-32) sit far below
Mosaic GPU's 64-row wgmma tile, so a Mosaic GPU kernel must put the weight on wgmma's M side and
hand back a transposed product, whose split-K partial sums cost a fusion per projection
(``skinny_gemm_mgpu``, measured no faster than cuBLAS in the engine); here each program keeps its
output columns' whole K in registers and finishes the epilogue itself.

Algorithm. Program ``j`` of the grid ``(cdiv(N_out, block_n),)`` owns output columns
``[j*block_n, (j+1)*block_n)`` and walks K in ``block_k`` steps, loading the weight tile
``[block_k, block_n]`` (rows of ``block_n`` contiguous elements) and the matching ``[rows, block_k]``
of ``x`` (tiny, from L2). One row multiplies on the CUDA cores into a ``[block_k, block_n]`` f32
accumulator summed over K once at the end; more rows are padded to 16 or 32 and multiply on the
tensor cores (``tl.dot``). With a norm, a first pass over ``x`` computes each row's scale. With
``silu_mul`` the program also loads the matching ``up`` tile ``I`` columns on.

Numerics follow the jnp reference (and the engine's layers): the product accumulates in f32 and is
rounded to the input dtype before the epilogue, as XLA's dot then the elementwise ops would.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["MAX_ROWS", "accepts", "decode_gemv", "decode_gemv_reference"]

MAX_ROWS = 32
ACTIVATIONS = (None, "silu_mul")


def accepts(x, stack) -> bool:
    """Whether ``decode_gemv`` takes these operands (else the caller uses XLA's dot)."""
    return (x.ndim == 2 and stack.ndim == 3 and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] == stack.shape[1]
            and x.dtype == stack.dtype and x.dtype in (jnp.bfloat16, jnp.float16, jnp.float32))


def _check(x, stack, norm, activation, residual):
    if not accepts(x, stack):
        raise ValueError(f"decode_gemv: x {x.shape} {x.dtype} and stack {stack.shape} {stack.dtype}: expected "
                         f"x [M <= {MAX_ROWS}, K] and stack [L, K, N] of one float dtype")
    if activation not in ACTIVATIONS:
        raise ValueError(f"decode_gemv: activation {activation!r} not in {ACTIVATIONS}")
    n = stack.shape[2]
    if activation == "silu_mul" and n % 2:
        raise ValueError(f"decode_gemv: silu_mul needs an even [gate | up] width, got {n}")
    n_out = n // 2 if activation == "silu_mul" else n
    if residual is not None and residual.shape != (x.shape[0], n_out):
        raise ValueError(f"decode_gemv: residual {residual.shape}, expected {(x.shape[0], n_out)}")
    if norm is not None and norm[0].shape != stack.shape[:2]:
        raise ValueError(f"decode_gemv: norm weights {norm[0].shape}, expected {stack.shape[:2]}")
    return n_out


def _kernel(layer_ref, x_ref, w_ref, norm_ref, res_ref, out_ref, *, rows, k_dim, n_out, block_m, block_n, block_k,
            wave, eps, has_norm, silu_mul, has_residual):
    layer = layer_ref[0]
    dtype = x_ref.dtype
    m = jnp.arange(block_m, dtype=jnp.int32)
    m_ok = m < rows
    col = pl.program_id(0) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    col_ok = col < n_out
    ks = [i * block_k + jnp.arange(block_k, dtype=jnp.int32) for i in range(pl.cdiv(k_dim, block_k))]

    def x_tile(k):
        return pltriton.load(x_ref.at[m[:, None], k[None, :]], mask=m_ok[:, None] & (k < k_dim)[None, :], other=0)

    def w_tiles(k):
        mask = (k < k_dim)[:, None] & col_ok[None, :]
        return [pltriton.load(w_ref.at[(layer * k_dim + k)[:, None], (col + offset)[None, :]], mask=mask, other=0)
                for offset in ((0, n_out) if silu_mul else (0,))]

    if has_norm:  # each row's RMS scale, from x (a few KB, read from L2)
        squares = [jnp.sum(jnp.square(x_tile(k).astype(jnp.float32)), axis=1) for k in ks]
        scale = lax.rsqrt(functools.reduce(jnp.add, squares) / k_dim + eps)

    acc_shape = (block_k, block_n) if block_m == 1 else (block_m, block_n)
    accs = [jnp.zeros(acc_shape, jnp.float32) for _ in range(1 + silu_mul)]
    # K in waves of tiles whose loads are all issued before their arithmetic: the column block's
    # bytes are in flight together, which is what keeps HBM busy with one program per SM.
    for first in range(0, len(ks), wave):
        group = ks[first:first + wave]
        tiles = [w_tiles(k) for k in group]
        for k, tile in zip(group, tiles):
            xk = x_tile(k)
            if has_norm:
                weight = pltriton.load(norm_ref.at[layer, k], mask=k < k_dim, other=0)
                xk = weight[None, :] * (xk.astype(jnp.float32) * scale[:, None]).astype(dtype)
            for j, w in enumerate(tile):
                if block_m == 1:  # CUDA cores: multiply now, sum over K once at the end
                    accs[j] = accs[j] + xk.astype(jnp.float32).reshape(block_k, 1) * w.astype(jnp.float32)
                else:
                    accs[j] = accs[j] + jnp.dot(xk, w, preferred_element_type=jnp.float32)
    if block_m == 1:
        accs = [jnp.sum(acc, axis=0).reshape(1, block_n) for acc in accs]
    out = accs[0].astype(dtype)
    if silu_mul:
        sig = (1.0 / (1.0 + jnp.exp(-out.astype(jnp.float32)))).astype(dtype)
        out = (out * sig) * accs[1].astype(dtype)
    mask = m_ok[:, None] & col_ok[None, :]
    if has_residual:
        out = pltriton.load(res_ref.at[m[:, None], col[None, :]], mask=mask, other=0) + out
    pltriton.store(out_ref.at[m[:, None], col[None, :]], out.astype(out_ref.dtype), mask=mask)


def default_block_n(rows: int, n_out: int, programs: int = 128) -> int:
    """Output columns per program: the widest of 8-64 that still gives ``programs`` programs (one an
    SM), at least 16 where the rows multiply on the tensor cores."""
    narrowest = 8 if rows == 1 else 16
    width = 64
    while width > narrowest and n_out // width < programs:
        width //= 2
    return width


def decode_gemv(x, stack, layer, *, norm=None, activation=None, residual=None, interpret=False, block_n=None,
                block_k=None, wave_bytes=64 * 1024, num_warps=8):
    """``[residual +] act(rms_norm(x) @ stack[layer])`` for ``x [M <= 32, K]``.

    Args:
      x: ``[M, K]``, the rows (1 <= M <= 32).
      stack: ``[L, K, N]`` stacked weights, read in place at ``layer``.
      layer: int32 scalar (may be traced).
      norm: ``(weights [L, K], eps)``, RMSNorm of ``x`` with ``weights[layer]`` first; or None.
      activation: None, or ``"silu_mul"``: ``silu(y[:, :N/2]) * y[:, N/2:]``.
      residual: ``[M, N_out]`` added to the result, or None.
      block_n, block_k, wave_bytes, num_warps: tuning: output columns per program, K per tile, the
        weight bytes a program loads at once (defaults by the rows and shapes).

    Returns:
      ``[M, N_out]`` in ``x``'s dtype (``N_out = N``, or ``N / 2`` with ``silu_mul``).
    """
    n_out = _check(x, stack, norm, activation, residual)
    rows, k_dim = x.shape
    num_layers, _, n = stack.shape
    block_m = 1 if rows == 1 else max(16, pl.next_power_of_2(rows))
    block_n = block_n or default_block_n(rows, n_out)
    block_k = min(block_k or 256, max(16, pl.next_power_of_2(k_dim)))
    wave = max(1, wave_bytes // (block_k * block_n * stack.dtype.itemsize * (2 if activation else 1)))
    has_norm, has_residual = norm is not None, residual is not None
    norm_weights = norm[0].astype(x.dtype) if has_norm else jnp.zeros((1, 1), x.dtype)
    kernel = functools.partial(_kernel, rows=rows, k_dim=k_dim, n_out=n_out, block_m=block_m, block_n=block_n,
                               block_k=block_k, wave=wave, eps=norm[1] if has_norm else 0.0, has_norm=has_norm,
                               silu_mul=activation == "silu_mul", has_residual=has_residual)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n_out, block_n),),
        out_shape=jax.ShapeDtypeStruct((rows, n_out), x.dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name="decode_gemv",
    )(jnp.asarray(layer, jnp.int32).reshape(1), x, stack.reshape(num_layers * k_dim, n), norm_weights,
      residual if has_residual else jnp.zeros((1, 1), x.dtype))


def decode_gemv_reference(x, stack, layer, *, norm=None, activation=None, residual=None, interpret=False,
                          **unused_tuning):
    """Pure-jnp ``decode_gemv``: the engine's layer ops, one after the other."""
    del interpret, unused_tuning
    _check(x, stack, norm, activation, residual)
    if norm is not None:
        weights, eps = norm
        x32 = x.astype(jnp.float32)
        normed = (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
        x = weights[layer].astype(x.dtype) * normed
    y = jnp.dot(x, stack[layer], preferred_element_type=jnp.float32).astype(x.dtype)
    if activation == "silu_mul":
        gate, up = jnp.split(y, 2, axis=-1)
        y = jax.nn.silu(gate) * up
    return y if residual is None else residual + y
