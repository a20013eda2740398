"""Grouped GEMM for mixture-of-experts layers (Pallas, Triton backend).

Why the Triton backend: this is the MoE path on GPUs without wgmma (compute capability below 9);
Hopper-class GPUs run grouped_gemm_mgpu.py by default (`moe_backend=auto`).

``grouped_gemm(lhs[M, K], rhs[G, K, N], group_sizes[G]) -> out[M, N]`` has the semantics of
``jax.lax.ragged_dot``: the rows of ``lhs`` are sorted by group, rows
``[off_g, off_g + group_sizes[g])`` are multiplied by ``rhs[g]``, and rows past
``sum(group_sizes)`` come out as zeros. In a MoE layer the rows are the (token, expert) pairs
sorted by expert and ``rhs`` holds every expert's weight.

Why a kernel: in jax 0.11.2 ``ragged_dot`` lowers on GPU to a dense materialisation (every row
times every group's weight), i.e. ``G`` times the work.

Algorithm. Each group's rows are cut into tiles of ``block_m`` rows that start at the
group's first row, so no tile straddles two groups; an empty group has no tile. A tiny jnp
prologue (``_tile_schedule``) lists, per tile, its group, first row and the group's row end.
The grid is ``(max_tiles, cdiv(N, block_n))`` where ``max_tiles`` is the static upper bound
``cdiv(M, block_m) + G + 1``; tiles past the real count are idle. Program ``(t, j)`` loops over
K in ``block_k`` steps, accumulating ``lhs[rows, k] @ rhs[g, k, cols]`` in float32, and stores
its rows with a mask (rows of the next group belong to the next tile). Rows past the last
group form a pseudo-group whose tiles store zeros, which keeps the output fully defined.

FP8 weights. With ``rhs_scale`` (``[G, cdiv(K, sb), cdiv(N, sb)]`` float32, ``sb`` =
``scale_block``, the layout of block-scaled FP8 checkpoints), ``rhs`` may be float8: each
loaded tile is converted in registers and its partial product multiplied by the one scale of
its ``sb x sb`` block (``block_k`` and ``block_n`` divide ``sb``). The weights stay FP8 in
memory, so the kernel reads one byte per weight.

Like the other kernels here, refs are whole arrays in GPU memory and tiles are gathered with
explicit row/column indices; masked-off rows (and columns) of a store point one past the end, where the GPU never
touches memory and the interpreter's emulated masked store drops the write.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["default_block_m", "grouped_gemm", "grouped_gemm_reference"]


def default_block_m(num_rows: int, num_groups: int) -> int:
    """Rows per tile: about the mean group size (a decode step gives each expert a handful of
    rows; a long prefill gives it hundreds), as a power of two in [16, 128]."""
    mean = max(1, num_rows // max(1, num_groups))
    return int(min(128, max(16, 1 << (mean - 1).bit_length())))


def _tile_schedule(group_sizes, num_rows: int, block_m: int):
    """-> int32[3 * max_tiles]: per tile its group (-1: zero-fill, -2: idle), first row and
    the group's end row, concatenated."""
    G = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows)
    ends = jnp.concatenate([ends, jnp.full((1,), num_rows, jnp.int32)])  # + the zero tail
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    tiles = (ends - starts + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles)
    max_tiles = pl.cdiv(num_rows, block_m) + G + 1
    t = jnp.arange(max_tiles, dtype=jnp.int32)
    owner = jnp.searchsorted(tile_end, t, side="right", method="scan_unrolled").astype(jnp.int32)  # G + 1 past the end
    g = jnp.minimum(owner, G)
    row0 = starts[g] + (t - (tile_end[g] - tiles[g])) * block_m
    group = jnp.where(owner < G, owner, jnp.where(owner == G, -1, -2))
    return jnp.concatenate([group, row0, ends[g]]), max_tiles


def _kernel(meta_ref, lhs_ref, rhs_ref, *rest, num_rows, k_dim, n_dim, max_tiles, block_m,
            block_n, block_k, scale_block, has_scale):
    if has_scale:
        scale_ref, out_ref = rest
    else:
        (out_ref,) = rest
    M, K, N, BM, BN, BK = num_rows, k_dim, n_dim, block_m, block_n, block_k
    t, j = pl.program_id(0), pl.program_id(1)
    g = meta_ref[t]
    row0 = meta_ref[max_tiles + t]
    row_end = meta_ref[2 * max_tiles + t]

    rows = row0 + jnp.arange(BM, dtype=jnp.int32)
    row_ok = rows < row_end
    cols = j * BN + jnp.arange(BN, dtype=jnp.int32)
    col_ok = cols < N
    out_mask = row_ok[:, None] & col_ok[None, :]
    out_rows = jnp.where(row_ok, rows, M)[:, None]
    out_cols = jnp.where(col_ok, cols, N)[None, :]

    @pl.when(g >= 0)
    def _compute():
        # f32 operands: the Triton lowering would use TF32 unless asked for IEEE f32.
        precision = lax.Precision.HIGHEST if lhs_ref.dtype == jnp.float32 else None
        a_rows = jnp.minimum(rows, M - 1)[:, None]
        b_cols = jnp.minimum(cols, N - 1)[None, :]
        n_scale_k = pl.cdiv(K, scale_block)
        n_scale_n = pl.cdiv(N, scale_block)

        def step(kb, acc):
            ks = kb * BK + jnp.arange(BK, dtype=jnp.int32)
            k_ok = ks < K
            k_idx = jnp.minimum(ks, K - 1)
            a = pltriton.load(lhs_ref.at[a_rows, k_idx[None, :]],
                              mask=row_ok[:, None] & k_ok[None, :], other=0)
            b_ok = k_ok[:, None] & col_ok[None, :]
            b_at = rhs_ref.at[(g * K + k_idx)[:, None], b_cols]
            if jnp.issubdtype(rhs_ref.dtype, jnp.floating) and jnp.finfo(rhs_ref.dtype).bits == 8:
                # Float8: the Triton lowering cannot cast a masked load's fill value to fp8
                # ("cannot cast ... tt.splat", H200, jax 0.11.2). The indices are clamped, so
                # an unmasked load stays in bounds; the mask is applied after the conversion.
                b = jnp.where(b_ok, pltriton.load(b_at).astype(a.dtype), 0)
            else:
                b = pltriton.load(b_at, mask=b_ok, other=0).astype(a.dtype)
            part = pltriton.dot(a, b, precision=precision)
            if has_scale:
                s_idx = (g * n_scale_k + lax.div(kb * BK, scale_block)) * n_scale_n + lax.div(j * BN, scale_block)
                part = part * scale_ref[s_idx]
            return acc + part

        acc = lax.fori_loop(0, pl.cdiv(K, BK), step, jnp.zeros((BM, BN), jnp.float32))
        pltriton.store(out_ref.at[out_rows, out_cols], acc.astype(out_ref.dtype), mask=out_mask)

    @pl.when(g == -1)
    def _zero_fill():
        pltriton.store(out_ref.at[out_rows, out_cols], jnp.zeros((BM, BN), out_ref.dtype), mask=out_mask)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "scale_block",
                                             "num_warps", "num_stages", "interpret", "out_dtype"))
def grouped_gemm(lhs, rhs, group_sizes, rhs_scale=None, *, block_m: int | None = None,
                 block_n: int = 128, block_k: int = 64, scale_block: int = 128,
                 num_warps: int = 4, num_stages: int = 3, interpret: bool = False, out_dtype=None):
    """lhs[M, K] (rows sorted by group), rhs[G, K, N], group_sizes int32[G] -> [M, N].

    ``rhs_scale``: optional float32 ``[G, cdiv(K, scale_block), cdiv(N, scale_block)]`` block
    scales (``rhs`` then usually float8_e4m3fn). Output dtype: ``out_dtype`` or lhs's dtype.
    """
    M, K = lhs.shape
    G, K2, N = rhs.shape
    if K2 != K or group_sizes.shape != (G,):
        raise ValueError(f"shapes lhs {lhs.shape}, rhs {rhs.shape}, group_sizes {group_sizes.shape}")
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if M == 0:
        return jnp.zeros((0, N), out_dtype)
    block_m = block_m or default_block_m(M, G)
    block_k = min(block_k, max(16, 1 << (K - 1).bit_length()))
    block_n = min(block_n, max(16, 1 << (N - 1).bit_length()))
    has_scale = rhs_scale is not None
    if has_scale:  # one scale per tile: the tile must not cross a scale block
        block_k, block_n = min(block_k, scale_block), min(block_n, scale_block)
        if scale_block % block_k or scale_block % block_n:
            raise ValueError(f"block_k={block_k} and block_n={block_n} must divide scale_block={scale_block}")
        expected = (G, pl.cdiv(K, scale_block), pl.cdiv(N, scale_block))
        if rhs_scale.shape != expected:
            raise ValueError(f"rhs_scale has shape {rhs_scale.shape}, expected {expected}")
    if G * K * N >= 2**31 or M * max(K, N) >= 2**31:
        raise ValueError("operands have >= 2**31 elements; int32 indices would overflow")

    meta, max_tiles = _tile_schedule(group_sizes, M, block_m)
    kernel = functools.partial(
        _kernel, num_rows=M, k_dim=K, n_dim=N, max_tiles=max_tiles, block_m=block_m,
        block_n=block_n, block_k=block_k, scale_block=scale_block, has_scale=has_scale)
    args = [meta, lhs, rhs.reshape(G * K, N)]
    if has_scale:
        args.append(rhs_scale.astype(jnp.float32).reshape(-1))
    return pl.pallas_call(
        kernel,
        grid=(max_tiles, pl.cdiv(N, block_n)),
        out_shape=jax.ShapeDtypeStruct((M, N), out_dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="grouped_gemm",
    )(*args)


def dequantize_blocks(w, scale, scale_block: int = 128, dtype=jnp.float32):
    """Block-scaled weights [..., K, N] with scales [..., cdiv(K, sb), cdiv(N, sb)] -> dtype."""
    K, N = w.shape[-2:]
    full = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), scale_block, axis=-2), scale_block, axis=-1)
    return (w.astype(jnp.float32) * full[..., :K, :N]).astype(dtype)


def grouped_gemm_reference(lhs, rhs, group_sizes, rhs_scale=None, *, scale_block: int = 128,
                           out_dtype=None, **_):
    """Same contract as ``grouped_gemm``, via ``jax.lax.ragged_dot`` (FP8 weights are
    dequantised first)."""
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if rhs_scale is not None:
        rhs = dequantize_blocks(rhs, rhs_scale, scale_block, lhs.dtype)
    out = lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32),
                         precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)
