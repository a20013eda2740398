"""Paged decode attention over the stacked paged KV cache (Pallas, Mosaic GPU backend).

Contract. ``paged_decode_attention_mgpu(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, *,
layer, sm_scale)`` is ``ragged_paged_attention`` for a step in which every row has exactly one query
token (pure decode, ``query_start_loc = arange(R + 1)``), with the same cache layout and metadata:
``q [R, Hq, D]`` bf16 (row ``i``'s token), caches ``[num_layers, num_blocks, Hkv, block_size, D]``
bf16 read at layer ``layer`` (an int32 scalar, may be traced: the ``lax.scan`` index), row ``i``'s
keys are positions ``0 .. seq_lens[i]-1`` of its pages ``block_tables[i]`` (``page = pos //
block_size``), the query sees all of them (it is the last position), and the ``G = Hq / Hkv`` query
heads ``kv_head*G .. kv_head*G + G-1`` share KV head ``kv_head``. Returns ``[R, Hq, D]`` bf16 with
**zeros for the padding rows** ``i >= num_seqs`` (and for rows with ``seq_lens[i] == 0``).
``ragged_paged_attention_reference`` with ``query_start_loc = arange(R + 1)`` is the reference. No
sliding window. Cache contents past ``seq_lens[i]`` may be anything, NaN included: they never reach
the output. Shapes the kernel cannot take raise ``ValueError``: ``D`` a multiple of 64, ``G <= 8``,
``block_size`` a multiple of 8 that divides 64 or is a multiple of 64.

Why. A decode step reads every row's whole context of K and V once and does ~2 flops per byte, so
it is bound by HBM bandwidth: the aim is to keep enough bytes in flight on every SM to read the
cache at copy bandwidth. The Triton kernel gathers keys per token with pointer arithmetic and puts
the G query heads on the MMA's M side (16 at least); this one streams whole pages with TMA and puts
the keys on wgmma's M side.

Algorithm. One CTA (one warpgroup) per (row, KV head, split); grid ``(R, Hkv, num_splits)``.

* Tiles: the row's context is cut into tiles of ``TILE = 64`` tokens (wgmma's M), ``cdiv(seq_len,
  64)`` of them; split ``s`` of ``S`` takes the ``s``-th of ``S`` equal contiguous ranges of the
  row's real tiles (``cdiv(tiles, S)`` each, the last ones shorter or empty), so work follows the
  real length, not the block table's width.
* Pipeline: a ring of ``max_concurrent_steps`` stages, each a ``[64, D]`` tile of K and one of V
  in shared memory (128-byte swizzled). Filling a stage is ``64 / block_size`` TMA copies per cache
  (one page's ``[block_size, D]`` slab of this KV head is contiguous), the page numbers read as
  scalars from ``block_tables`` in global memory, all arriving on the stage's K (or V) barrier. The
  CTA issues the first stages up front and refills a stage's K as soon as the step's score wgmma has
  read it and its V once the value wgmma has, so ``max_concurrent_steps - 1`` to
  ``max_concurrent_steps`` tiles are in flight while it computes.
  (``plgpu.emit_pipeline`` takes one BlockSpec block per input per step; a 64-token tile of 16-token
  pages is 4 unrelated blocks that wgmma must read as one ``[64, D]`` operand, hence a hand-written
  ring.)
* Scores: ``S^T [64, 8] = K_tile [64, D] @ q^T [D, 8]`` with one wgmma: the keys on M, the G query
  heads zero-padded to 8 on N (``q`` is padded to ``[R, Hkv, 8, D]`` by a tiny jnp op and the CTA's
  ``[8, D]`` slab is read by one TMA copy at the start). Tokens past ``seq_len`` get a finite minus
  infinity.
* Online softmax over tokens (base 2, ``sm_scale * log2 e`` folded into the scores): running max
  and sum per query head (column of ``S^T``), reduced over the tile's 64 rows (across the
  warpgroup's 4 warps).
* Values: ``O^T [D, 8] += V_tile^T [D, 64] @ P^T [64, 8]`` with one wgmma: ``head_dim`` on M (V's
  tile read transposed, MN-major, which wgmma allows for 16-bit types), ``P^T`` in bf16 stored
  through the transposed view of an ``[8, 64]`` swizzled shared-memory tile (wgmma's B operand lives
  in shared memory). On the last, partial tile the values of the tokens past ``seq_len`` are zeroed
  in shared memory first (``p = 0`` there, but ``0 * NaN`` of a stale slot is NaN).
* Partials: each CTA writes its unnormalised ``O^T`` (f32 ``[D, 8]``) and its running max and sum
  (``[2, 8]``) through shared memory with TMA; a jnp epilogue (one XLA fusion) merges the splits
  with the usual log-sum-exp weights, drops the padding heads, normalises and transposes. Empty
  splits and padding rows write ``O = 0``, a finite minus infinity as the max and a sum of 0, so
  they weigh 0 and a row with no keys comes out as 0. The epilogue runs for ``S = 1`` too (one
  code path); its traffic is ``R * Hkv * S * D * 8 * 4`` bytes, next to ``R * seq_len * Hkv * D *
  4`` of K and V.

Default config (``default_config``) for ``num_sms`` SMs (the device's count on a GPU, else the
H200's 132): ``max_concurrent_steps = 3`` (3 x 32 KB of K and V per CTA, ~106 KB of shared memory
with q, P and the output tiles, so 2 CTAs fit on an SM and 4-6 tiles are in flight per SM);
``num_splits`` = the smallest power of two that gives ``R * Hkv * S >= 4 * num_sms`` CTAs, as long
as each split keeps at least 4 tiles of the widest row (``block_tables``' width): Qwen3-0.6B at 4K
context (8 KV heads) gets ``S = 1`` (2048 CTAs) at 256 rows and ``S = 4`` (1024 CTAs, 16 tiles each)
at 32 rows.

Constraints of the Mosaic GPU lowering (Lane semantics, shared memory tiled ``(8, 64)`` and
128-byte swizzled, as in jax's ``attention_mgpu``): wgmma's M is 64 (so 64-token tiles, and
``head_dim`` a multiple of 64 for ``O^T``); its N takes multiples of 8 (the padded heads); a
16-byte swizzle does not exist, so ``P^T [64, 8]`` cannot be its own B tile and is stored transposed
into an ``[8, 64]`` tile (``p_smem.T[...] = p``) read back through ``.T`` (K-major); a page's slab
is copied into rows ``[j * block_size, ...)`` of the stage, so ``block_size`` is a multiple of the
8-row tiling; each TMA copy moves a multiple of 128 bytes. The interpreter has two gaps that shape the
code: it cannot store into a wgmma accumulator ref (``acc_ref[...] = x``) nor run wgmma under
``pl.run_state``, so each wgmma gets a fresh zero accumulator (``pl.run_scoped``) and the rescaled
``O^T`` is carried in registers (``acc * alpha + pv``, a ``[128, 8]`` add per tile).

On the CPU (tests) the kernel runs in Mosaic GPU's interpreter (``interpret=True``), which checks
reads against the buffers' bounds but not the real lowering's layouts, and runs wgmma synchronously;
lowering for CUDA on any backend (``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``)
runs Mosaic GPU's lowering down to wgmma and TMA instructions, which checks the rest short of PTX.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mgpu_common import check_bf16_paged_attention, device_sm_count, one_kernel_per_shape

__all__ = ["DecodeConfig", "default_config", "paged_decode_attention_mgpu"]

TILE = 64  # KV tokens per pipeline step: wgmma's M for S^T = K @ q^T
_HEAD_PAD = 8  # wgmma's N takes multiples of 8: the G query heads of a KV head are padded to this
_NEG = -1e30  # finite "minus infinity" (exp2(_NEG - _NEG) = 1, not NaN, for a split with no key yet)
_LOG2E = math.log2(math.e)
_TARGET_CTAS_PER_SM = 4  # the split rule's target, the Triton kernel's too


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """The kernel's tiling: grid ``(rows, kv heads, num_splits)``, ``TILE`` tokens per step through a
    ring of ``max_concurrent_steps`` shared-memory stages."""

    num_splits: int = 1
    max_concurrent_steps: int = 3


def default_config(num_rows: int, num_kv_heads: int, max_context: int, *, num_sms: int | None = None) -> DecodeConfig:
    """The config for ``num_rows`` decode rows of up to ``max_context`` tokens (the module docstring's
    rule)."""
    target = (num_sms or device_sm_count()) * _TARGET_CTAS_PER_SM
    ctas = max(1, num_rows * num_kv_heads)
    tiles = max(1, -(-max_context // TILE))
    splits = 1
    while ctas * splits < target and tiles // (2 * splits) >= 4:  # keep >= 4 tiles per split
        splits *= 2
    return DecodeConfig(num_splits=splits, max_concurrent_steps=3)


def _check(q, k_cache, v_cache, block_tables, seq_lens, config: DecodeConfig) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be [R, Hq, D] (one query token per row), got shape {tuple(q.shape)}")
    check_bf16_paged_attention(q, k_cache, v_cache)
    num_rows, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, block_size, _ = k_cache.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq = {num_q_heads} query heads is not a multiple of Hkv = {num_kv_heads} KV heads")
    if num_q_heads // num_kv_heads > _HEAD_PAD:
        raise ValueError(f"G = Hq / Hkv = {num_q_heads // num_kv_heads} query heads per KV head: at most "
                         f"{_HEAD_PAD} are supported")
    if head_dim % 64:
        raise ValueError(f"head_dim = {head_dim} must be a multiple of 64 (wgmma's M for O^T = V^T P^T)")
    if block_size % 8 or (TILE % block_size and block_size % TILE):
        raise ValueError(f"block_size = {block_size} must be a multiple of 8 that divides {TILE} or that "
                         f"{TILE} divides")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_rows:
        raise ValueError(f"block_tables must be [R = {num_rows}, max_blocks], got {tuple(block_tables.shape)}")
    if seq_lens.shape != (num_rows,):
        raise ValueError(f"seq_lens must be [R = {num_rows}], got {tuple(seq_lens.shape)}")
    if config.num_splits < 1:
        raise ValueError(f"num_splits = {config.num_splits} must be positive")
    if config.max_concurrent_steps < 1:
        raise ValueError(f"max_concurrent_steps = {config.max_concurrent_steps} must be positive")


def _decode_kernel(layer_gmem, num_seqs_gmem, seq_lens_gmem, bt_gmem, q_gmem, k_gmem, v_gmem,
                   acc_gmem, ml_gmem, *, num_rows, max_blocks, num_blocks, block_size, num_splits,
                   stages, scale_log2):
    row = lax.axis_index("row")
    head = lax.axis_index("head")
    split = lax.axis_index("split")
    head_dim = q_gmem.shape[-1]
    pages_per_tile = max(1, TILE // block_size)
    page_rows = min(block_size, TILE)
    layer = layer_gmem[0]
    is_real = row < jnp.minimum(num_seqs_gmem[0], num_rows)
    seq_len = jnp.where(is_real, jnp.clip(seq_lens_gmem[row], 0, max_blocks * block_size), 0)
    n_tiles = lax.div(seq_len + TILE - 1, TILE)
    per_split = lax.div(n_tiles + num_splits - 1, num_splits)
    t_lo = jnp.minimum(split * per_split, n_tiles)
    steps = jnp.minimum(t_lo + per_split, n_tiles) - t_lo

    def body(q_smem, k_smem, v_smem, p_smem, o_smem, ml_smem, q_bar, k_bar, v_bar):
        def issue(step, slot, caches=((k_gmem, k_smem, k_bar), (v_gmem, v_smem, v_bar))):
            """TMA copies of tile ``t_lo + step``'s pages of ``caches`` (K and V) into stage ``slot``."""
            tile = t_lo + step
            for j in range(pages_per_tile):
                if block_size <= TILE:
                    page = tile * pages_per_tile + j
                    offset = 0
                else:
                    page = lax.div(tile * TILE, block_size)
                    offset = lax.rem(tile * TILE, block_size)
                blk = jnp.clip(bt_gmem[row * max_blocks + jnp.minimum(page, max_blocks - 1)], 0, num_blocks - 1)
                dst = pl.ds(j * page_rows, page_rows)
                src = (layer, blk, head, pl.ds(offset, page_rows))
                for gmem, smem, bar in caches:
                    plgpu.copy_gmem_to_smem(gmem.at[src], smem.at[slot, dst], bar.at[slot])

        plgpu.copy_gmem_to_smem(q_gmem.at[row, head], q_smem, q_bar)
        for i in range(stages):
            pl.when(i < steps)(functools.partial(issue, i, i))
        plgpu.barrier_wait(q_bar)

        def kv_step(step, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(step, stages)
            tile = t_lo + step
            plgpu.barrier_wait(k_bar.at[slot])

            def scores(s_ref):
                plgpu.wgmma(s_ref, k_smem.at[slot], q_smem.T)
                plgpu.wgmma_wait(0)
                return s_ref[...]

            s = pl.run_scoped(scores, plgpu.ACC((TILE, _HEAD_PAD), jnp.float32))
            # The stage's K is read: refill it now, its V once P V is done.
            refill = step + stages < steps
            pl.when(refill)(functools.partial(issue, step + stages, slot, ((k_gmem, k_smem, k_bar),)))
            tok = plgpu.broadcasted_iota(jnp.int32, (TILE, _HEAD_PAD), 0, layout=plgpu.Layout.WGMMA)
            live = tok < seq_len - tile * TILE
            s = jnp.where(live, s * scale_log2, _NEG)
            m_new = jnp.maximum(m_i, s.max(axis=0))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [1]))
            l_i = l_i * alpha + p.sum(axis=0)
            p_smem.T[...] = p.astype(p_smem.dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_bar.at[slot])
            n_live = seq_len - tile * TILE

            @pl.when(n_live < TILE)
            def _zero_dead_values():
                # The keys past seq_len get p = 0, but 0 * a stale NaN is NaN: zero their values.
                v = plgpu.load(v_smem.at[slot], layout=plgpu.Layout.WGMMA)
                row_id = plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=plgpu.Layout.WGMMA)
                v_smem.at[slot][...] = jnp.where(row_id < n_live, v, jnp.zeros_like(v))
                plgpu.commit_smem()


            def values(o_ref):
                plgpu.wgmma(o_ref, v_smem.at[slot].T, p_smem.T)
                plgpu.wgmma_wait(0)
                return o_ref[...]

            pv = pl.run_scoped(values, plgpu.ACC((head_dim, _HEAD_PAD), jnp.float32))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1]) + pv
            pl.when(refill)(functools.partial(issue, step + stages, slot, ((v_gmem, v_smem, v_bar),)))
            return acc, m_new, l_i

        carry = (
            plgpu.layout_cast(jnp.zeros((head_dim, _HEAD_PAD), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((_HEAD_PAD,), _NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(0)),
            plgpu.layout_cast(jnp.zeros((_HEAD_PAD,), jnp.float32), plgpu.Layout.WGMMA.reduce(0)),
        )
        acc, m_i, l_i = lax.fori_loop(0, steps, kv_step, carry)
        o_smem[...] = acc
        ml_smem.at[0][...] = m_i
        ml_smem.at[1][...] = l_i
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, acc_gmem.at[row, head, split])
        plgpu.copy_smem_to_gmem(ml_smem, ml_gmem.at[row, head, split])
        plgpu.wait_smem_to_gmem(0)

    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    pl.run_scoped(
        body,
        plgpu.SMEM((_HEAD_PAD, head_dim), jnp.bfloat16, transforms=swizzled),
        plgpu.SMEM((stages, TILE, head_dim), jnp.bfloat16, transforms=swizzled),
        plgpu.SMEM((stages, TILE, head_dim), jnp.bfloat16, transforms=swizzled),
        plgpu.SMEM((_HEAD_PAD, TILE), jnp.bfloat16, transforms=swizzled),
        plgpu.SMEM((head_dim, _HEAD_PAD), jnp.float32),
        plgpu.SMEM((2, _HEAD_PAD), jnp.float32),
        plgpu.Barrier(),
        plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=stages),
        plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=stages),
    )


@one_kernel_per_shape("sm_scale", "config", "interpret")
def paged_decode_attention_mgpu(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, *, layer, sm_scale,
                                config: DecodeConfig | None = None, interpret=False):
    """Attention of each row's single query token over its paged context (the module docstring).

    Args:
      q: ``[R, Hq, D]`` bf16, row ``i``'s query token.
      k_cache, v_cache: ``[num_layers, num_blocks, Hkv, block_size, D]`` bf16; ``Hq % Hkv == 0``.
      block_tables: ``int32[R, max_blocks]``: row ``i``'s pages in order.
      seq_lens: ``int32[R]``: context lengths including this step's token.
      num_seqs: int32 scalar, the number of real rows; rows ``i >= num_seqs`` output zeros.
      layer: int32 scalar, may be traced (the ``lax.scan`` index).
      sm_scale: softmax scale, a static Python float (e.g. ``D ** -0.5``).
      config: the split and the pipeline depth; ``default_config(R, Hkv, max_blocks * block_size)``
        when None.
      interpret: run Mosaic GPU's interpreter on the CPU (CPU tests): ``True`` for its default
        ``plgpu.InterpretGPUParams()``, or such an instance.

    Returns:
      ``[R, Hq, D]`` bf16.
    """
    if config is None and q.ndim == 3 and block_tables.ndim == 2 and k_cache.ndim == 5:
        config = default_config(q.shape[0], k_cache.shape[2], block_tables.shape[1] * k_cache.shape[3])
    config = config or DecodeConfig()
    _check(q, k_cache, v_cache, block_tables, seq_lens, config)
    num_rows, num_q_heads, head_dim = q.shape
    _, num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    splits = config.num_splits
    max_tiles = -(-max_blocks * block_size // TILE)
    stages = max(1, min(config.max_concurrent_steps, -(-max_tiles // splits)))
    if num_rows == 0:
        return jnp.zeros_like(q)
    q_pad = q.reshape(num_rows, num_kv_heads, group, head_dim)
    q_pad = jnp.pad(q_pad, ((0, 0), (0, 0), (0, _HEAD_PAD - group), (0, 0)))
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    kernel = plgpu.kernel(
        functools.partial(_decode_kernel, num_rows=num_rows, max_blocks=max_blocks, num_blocks=num_blocks,
                          block_size=block_size, num_splits=splits, stages=stages,
                          scale_log2=float(sm_scale) * _LOG2E),
        out_type=(jax.ShapeDtypeStruct((num_rows, num_kv_heads, splits, head_dim, _HEAD_PAD), jnp.float32),
                  jax.ShapeDtypeStruct((num_rows, num_kv_heads, splits, 2, _HEAD_PAD), jnp.float32)),
        grid=(num_rows, num_kv_heads, splits),
        grid_names=("row", "head", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret or None,
        kernel_name="paged_decode_attention_mgpu",
    )
    acc, ml = kernel(jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(num_seqs, jnp.int32).reshape(1),
                     seq_lens.astype(jnp.int32), block_tables.astype(jnp.int32).reshape(-1), q_pad, k_cache, v_cache)
    return _merge(acc, ml, group).reshape(num_rows, num_q_heads, head_dim).astype(q.dtype)


def _merge(acc, ml, group):
    """Combines the splits' partials: ``acc [R, Hkv, S, D, 8]``, ``ml [R, Hkv, S, 2, 8]`` (running max
    in log2 units, running sum) -> ``[R, Hkv, G, D]`` f32."""
    acc, m, l = acc[..., :group], ml[..., 0, :group], ml[..., 1, :group]
    m_max = m.max(axis=2, keepdims=True)
    w = jnp.exp2(m - m_max)  # 0 for the splits that saw no key
    l_sum = (w * l).sum(axis=2)
    o = (w[:, :, :, None, :] * acc).sum(axis=2)  # [R, Hkv, D, G]
    o = o / jnp.where(l_sum > 0, l_sum, 1.0)[:, :, None, :]  # no key (padding rows): 0
    return o.transpose(0, 1, 3, 2)
