"""A decode projection with its neighbours, in one weight-streaming kernel (Pallas, Triton backend).

``decode_gemv(x, stack, layer)`` computes ``x @ stack[layer]`` for decode's few rows (``M <= 8``),
reading layer ``layer`` of a stacked ``[L, K, N]`` weight in place, and may take on the small
operations a decoder layer puts around its projections:

* ``norm=(weights [L, K], eps)``: RMSNorm of ``x``'s rows first (the layer's input norm; the stacked
  weights read in place too);
* ``activation="silu_mul"``: the weight is SwiGLU's fused ``[gate | up]`` (``N = 2 * I``) and the
  result ``silu(gate) * up`` (``[M, I]``);
* ``residual=[M, N]``: the result is ``residual + x @ w`` (o and down projections).

Why. At decode the projections stream their weights once per step for a few rows, so they are
bound by memory; around them a layer runs the norms, SwiGLU's product and the residual adds as
kernels of their own, each a launch that moves a few kilobytes (docs/benchmarks.md, "Decode
projections as weight-streaming GEMVs"). Why the Triton backend: the rows (1-8) sit far below
Mosaic GPU's 64-row wgmma tile, so a Mosaic GPU kernel must put the weight on wgmma's M side and
hand back a transposed product, whose split-K partial sums cost a fusion per projection
(``skinny_gemm_mgpu``, measured no faster than cuBLAS in the engine); here each program keeps its
output columns' whole K to itself and finishes the epilogue in registers.

Algorithm. Program ``j`` of the grid ``(cdiv(N_out, block_n),)`` owns output columns
``[j*block_n, (j+1)*block_n)`` and walks K in ``block_k``-deep weight tiles ``[block_k, block_n]``
(rows of ``block_n`` contiguous elements). It issues the loads of a wave of tiles (``wave_bytes``
of weight) before multiplying any of them, so that the column block's bytes are in flight
together: with one program per SM that is what keeps HBM busy. The multiply is on the CUDA cores
(a few rows do not fill a tensor-core tile): per row, ``x[row, k-tile]`` (a column read from L2)
times the tile, summed over the tile's K into an f32 ``[block_n]`` accumulator. By default a tile
is as deep as ``wave_bytes`` allows, so one load brings a whole wave. With a norm, a first pass
over ``x`` computes each row's scale. With ``silu_mul`` the program also loads the matching ``up``
tile ``I`` columns on.

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

MAX_ROWS = 8
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


def _kernel(layer_ref, x_ref, w_ref, norm_ref, res_ref, out_ref, *, rows, k_dim, n_out, block_n, block_k, wave,
            eps, has_norm, silu_mul, has_residual):
    layer = layer_ref[0]
    dtype = x_ref.dtype
    col = pl.program_id(0) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    col_ok = col < n_out
    ks = [i * block_k + jnp.arange(block_k, dtype=jnp.int32) for i in range(pl.cdiv(k_dim, block_k))]

    def x_column(m, k):  # x[m, k-tile] as a [block_k, 1] column, the weight tile's layout along K
        return pltriton.load(x_ref.at[m, k[:, None]], mask=(k < k_dim)[:, None], other=0)

    def w_tiles(k):
        mask = (k < k_dim)[:, None] & col_ok[None, :]
        return [pltriton.load(w_ref.at[(layer * k_dim + k)[:, None], (col + offset)[None, :]], mask=mask, other=0)
                for offset in ((0, n_out) if silu_mul else (0,))]

    if has_norm:  # each row's RMS scale, from x (a few KB, read from L2)
        scales = [lax.rsqrt(functools.reduce(jnp.add, [jnp.sum(jnp.square(x_column(m, k).astype(jnp.float32)))
                                                       for k in ks]) / k_dim + eps) for m in range(rows)]
    accs = [[jnp.zeros((block_n,), jnp.float32) for _ in range(1 + silu_mul)] for _ in range(rows)]
    for first in range(0, len(ks), wave):
        group = ks[first:first + wave]
        tiles = [w_tiles(k) for k in group]  # the wave's loads, issued before its arithmetic
        for k, tile in zip(group, tiles):
            tile = [w.astype(jnp.float32) for w in tile]
            if has_norm:
                weight = pltriton.load(norm_ref.at[layer, k[:, None]], mask=(k < k_dim)[:, None], other=0)
            for m in range(rows):
                xk = x_column(m, k)
                if has_norm:
                    xk = weight * (xk.astype(jnp.float32) * scales[m]).astype(dtype)
                xk = xk.astype(jnp.float32)
                accs[m] = [acc + jnp.sum(xk * w, axis=0) for acc, w in zip(accs[m], tile)]
    for m in range(rows):
        y = [acc.astype(dtype) for acc in accs[m]]
        out = y[0]
        if silu_mul:
            sig = (1.0 / (1.0 + jnp.exp(-out.astype(jnp.float32)))).astype(dtype)
            out = (out * sig) * y[1]
        if has_residual:
            out = pltriton.load(res_ref.at[m, col], mask=col_ok, other=0) + out
        pltriton.store(out_ref.at[m, col], out.astype(out_ref.dtype), mask=col_ok)


def default_block_n(n_out: int, programs: int = 96) -> int:
    """Output columns per program: the widest of 8-64 that still gives ``programs`` programs."""
    width = 64
    while width > 8 and n_out // width < programs:
        width //= 2
    return width


def decode_gemv(x, stack, layer, *, norm=None, activation=None, residual=None, interpret=False, block_n=None,
                block_k=None, wave_bytes=64 * 1024, num_warps=8):
    """``[residual +] act(rms_norm(x) @ stack[layer])`` for ``x [M <= 8, K]``.

    Args:
      x: ``[M, K]``, the rows (1 <= M <= 8).
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
    block_n = block_n or default_block_n(n_out)
    tile_bytes_per_k = block_n * stack.dtype.itemsize * (2 if activation else 1)
    # By default one tile as deep as wave_bytes allows: one load brings a wave's bytes in flight.
    block_k = min(block_k or 1 << (max(16, wave_bytes // tile_bytes_per_k).bit_length() - 1),
                  max(16, pl.next_power_of_2(k_dim)))
    wave = max(1, wave_bytes // (block_k * tile_bytes_per_k))
    has_norm, has_residual = norm is not None, residual is not None
    norm_weights = norm[0].astype(x.dtype) if has_norm else jnp.zeros((1, 1), x.dtype)
    kernel = functools.partial(_kernel, rows=rows, k_dim=k_dim, n_out=n_out, block_n=block_n,
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
