"""Decode's projection of a few tens of rows on tensor cores, from a weight stored ``[N, K]``, with the
layer's RMSNorm before it and a residual add or SwiGLU after it (Pallas, Triton backend).

Contract: ``gemv_triton.gemv``'s (``x [R, K]``, a weight or a stack read in place at ``layer=``,
``norm_weight``, ``epilogue`` ``None`` / ``"residual"`` / ``"swiglu"``; ``gemv_triton.gemv_reference`` is
the reference), for ``R`` from 1 to ``MAX_ROWS``.

Why. At 8-32 rows cuBLAS streams decode's weights at 0.65-0.95 TB/s (docs/benchmarks.md, session 51)
and the norm and the residual add or SwiGLU are kernels of their own. With a row count of 32 the
CUDA-core GEMV (one accumulator a row) runs out of registers; here the product is ``tl.dot`` on
tensor cores, and the weight streams through Triton's software pipeline (``num_stages`` loads in
flight a program).

Algorithm. Grid ``(N_out / block_n,)``: a program owns ``block_n`` outputs (with SwiGLU, their gate
rows and the matching up rows) for all R rows, as a tile of ``tile_rows(R)`` rows (a power of two, at
least 16, tensor cores' smallest M): the rows past R repeat x's last row and are not stored. With a
norm it first sums each row's squares over K
(x is small and stays in L2) for its ``rsqrt(mean(x^2) + eps)``, then scales each chunk of x by it and
the norm weight and rounds it to bf16, as the model does. A loop over K in ``block_k`` chunks adds
``dot(x[:, chunk], w[outputs, chunk].T)`` into f32 ``[R, block_n]`` accumulators; the product is rounded
to bf16, the epilogue applied, and the ``[R, block_n]`` tile stored.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.gemv_triton import as_stack, check_projection

__all__ = ["MAX_ROWS", "DecodeGemmConfig", "decode_gemm", "tile_rows"]

MAX_ROWS = 64


@dataclasses.dataclass(frozen=True)
class DecodeGemmConfig:
    """``block_n``: outputs a program; ``block_k``: K's chunk a step; ``num_warps``; ``num_stages``: chunks
    of weight in flight a program (Triton's software pipeline)."""

    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4


def tile_rows(rows: int) -> int:
    """The row count of a program's tiles for `rows` rows of x: the next power of two, at least 16."""
    return max(16, 1 << (rows - 1).bit_length())


def _kernel(layer_ref, x_ref, w_ref, g_ref, r_ref, o_ref, *, rows, n, k, block_n, block_k, eps, norm, epilogue):
    j = pl.program_id(0)
    layer = layer_ref[0]
    first = j * block_n
    tile = jnp.arange(tile_rows(rows), dtype=jnp.int32)[:, None]  # [tile_rows, 1]
    r = jnp.minimum(tile, rows - 1)  # x's row of each tile row: the rows past R read the last one
    outs = first + jnp.arange(block_n, dtype=jnp.int32)
    # Weight rows of the program's outputs in the [L * N, K] view: the gate's, then (SwiGLU) up's.
    w_rows = [layer * n + outs] + ([layer * n + n // 2 + outs] if epilogue == "swiglu" else [])
    steps = k // block_k

    def chunk(c):
        return pl.multiple_of(c * block_k, block_k) + jnp.arange(block_k, dtype=jnp.int32)

    scale = None
    if norm:
        def add_squares(c, squares):
            x = pltriton.load(x_ref.at[r, chunk(c)[None, :]]).astype(jnp.float32)
            return squares + x * x
        squares = lax.fori_loop(0, steps, add_squares, jnp.zeros((tile.shape[0], block_k), jnp.float32))
        scale = lax.rsqrt(jnp.sum(squares, axis=1) / k + eps)[:, None]  # [tile_rows, 1]

    def step(c, accs):
        cols = chunk(c)
        x = pltriton.load(x_ref.at[r, cols[None, :]])  # [tile_rows, block_k] bf16
        if norm:  # the model's rounding: the normalised x in bf16, times the norm weight
            weight = pltriton.load(g_ref.at[jnp.full((1, 1), layer, jnp.int32), cols[None, :]])
            x = ((x.astype(jnp.float32) * scale).astype(jnp.bfloat16).astype(jnp.float32)
                 * weight.astype(jnp.float32)).astype(jnp.bfloat16)
        # [block_k, block_n]: the weight tile transposed by its indices, each output's K contiguous.
        return tuple(acc + pltriton.dot(x, pltriton.load(w_ref.at[out_rows[None, :], cols[:, None]]))
                     for acc, out_rows in zip(accs, w_rows))

    accs = lax.fori_loop(0, steps, step, tuple(jnp.zeros((tile.shape[0], block_n), jnp.float32) for _ in w_rows))
    sums = [acc.astype(jnp.bfloat16).astype(jnp.float32) for acc in accs]  # the product's bf16 result
    if epilogue == "residual":
        y = sums[0] + pltriton.load(r_ref.at[r, outs[None, :]]).astype(jnp.float32)
    elif epilogue == "swiglu":
        gate, up = sums
        y = gate / (1 + jnp.exp(-gate)) * up
    else:
        y = sums[0]
    stored = None if tile.shape[0] == rows else jnp.broadcast_to(tile < rows, y.shape)
    pltriton.store(o_ref.at[tile, outs[None, :]], y.astype(o_ref.dtype), mask=stored)


def decode_gemm(x, w, *, layer=None, norm_weight=None, eps: float = 1e-6, epilogue=None, residual=None,
                config: DecodeGemmConfig | None = None, interpret=False):
    """``x [R, K] @ w.T`` (``w [N, K]``, or ``w[layer]`` of ``[L, N, K]``) in bf16 with f32 accumulation,
    with an RMSNorm of ``x`` before and a residual add or SwiGLU after (module docstring)."""
    if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be [R, K] with 1 <= R <= {MAX_ROWS} rows, got {tuple(x.shape)}")
    config = config or DecodeGemmConfig()
    check_projection(x, w, layer, norm_weight, epilogue, residual, block_n=config.block_n, block_k=config.block_k,
                     min_block=16)
    w, norm_weight = as_stack(w, norm_weight)
    num_layers, n, k = w.shape
    rows = x.shape[0]
    num_out = n // 2 if epilogue == "swiglu" else n
    g = jnp.ones((1, k), jnp.bfloat16) if norm_weight is None else norm_weight.astype(jnp.bfloat16)
    res = jnp.zeros((1, 1), jnp.bfloat16) if residual is None else residual.astype(jnp.bfloat16)  # read with it only
    kernel = functools.partial(_kernel, rows=rows, n=n, k=k, block_n=config.block_n, block_k=config.block_k,
                               eps=eps, norm=norm_weight is not None, epilogue=epilogue)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, num_out), jnp.bfloat16),
        grid=(num_out // config.block_n,),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        name="decode_gemm_triton",
    )(jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1), x, w.reshape(num_layers * n, k), g, res)
