"""Ragged paged attention for mixed prefill and decode steps (Pallas, Mosaic GPU backend).

Contract: that of ``ragged_paged_attention`` (ragged_paged_attention.py, docs/architecture.md), without
a sliding window. ``q [T, Hq, D]`` bf16; caches ``[num_layers, num_blocks, Hkv, block_size, D]`` bf16
read at ``layer`` (an int32 scalar, may be traced); row ``i`` owns query tokens ``q[qsl[i]:qsl[i+1]]``
at positions ``seq_lens[i] - q_len_i + j`` and sees its keys ``0 .. position`` (causal) through its pages
``block_tables[i]``; the ``G = Hq / Hkv`` query heads ``kv_head*G .. kv_head*G + G-1`` share KV head
``kv_head``. Returns ``[T, Hq, D]`` bf16, **zeros for the padding tokens** ``[qsl[num_seqs], T)``.
Cache contents a row may not read (past its context, unused block-table entries, other layers) may be
anything, NaN included. ``ragged_paged_attention_reference`` is the reference. Shapes the kernel cannot
take raise ``ValueError``: ``D`` a multiple of 64, ``G`` one of 1, 2, 4, 8, ``block_size`` a multiple of
8 that divides 64 or is a multiple of 64.

Why. Attention is a large share of an S2 step (input 1024 / output 128), and its prefill part is bound
by the tensor cores, which the Triton kernel leaves far from their peak (docs/benchmarks.md, "Paged
attention kernel"). Mosaic GPU reaches Hopper's wgmma and TMA, which FlashAttention-3 is built on.

Algorithm. One CTA of one warpgroup per (work tile, KV head).

* Work tiles: wgmma's M side is 64 query lanes per warpgroup, ``TQ = 64 / G`` consecutive tokens of one
  row times the G heads of the KV head (lane ``g * TQ + t``), so a KV tile read once serves every head
  that needs it, and a decode row (one token) fills G lanes instead of one. A jnp schedule
  (``tile_schedule``) cuts every row's tokens at tile windows that start on a multiple of 8 (a TMA copy
  into a tiled buffer must), plus the padding tokens as a pseudo-row of zero tiles; ``num_tiles``
  (``cdiv(T + 7 (R + 1), tile) + R + 1``) always suffice, a static count: each of the ``R + 1`` rows
  starts at most 7 tokens into its first window and ends at most one partial window. The tiles are
  ordered by their key count, longest first, so the long causal tiles start first and empty tiles come
  last. Each carries six int32s (``META_FIELDS``) that the kernel reads as scalars.
* Queries: the ``TQ`` tokens of the window (moved back to ``T - tile`` at the end of ``q``;
  the wrapper pads ``q`` to a multiple of 8 of at least one tile), one TMA copy per head into rows
  ``g * TQ ..`` of a ``[64, D]`` swizzled tile. Lanes whose token is not the tile's compute junk and are
  never stored.
* Keys: tiles of ``block_kv`` keys (64 or 128) through a ring of ``max_concurrent_steps`` shared-memory
  stages, each filled by ``block_kv / block_size`` TMA copies per cache (a page's ``[block_size, D]``
  slab of one KV head is contiguous; page numbers read as scalars from ``block_tables``). The warpgroup
  refills a stage as soon as its wgmma has read it (the ring of paged_decode_attention_mgpu.py).
* Scores ``S [64, block_kv] = Q [64, D] @ K^T`` (one wgmma), the causal mask per lane (``key <=
  position``), online softmax in base 2 (``sm_scale * log2 e`` folded in), ``P`` rounded to bf16 into a
  swizzled ``[64, block_kv]`` tile, ``O [64, D] += P @ V`` (one wgmma). On the last, partial key tile
  the values past the tile's context are zeroed in shared memory first (``p = 0`` there, but ``0 * NaN``
  of a stale slot is NaN).
* Output: ``O / l`` in bf16 into an untiled ``[64, D]`` tile, then per head the tile's rows go out
  by a ladder of TMA copies of ``2^j`` rows (a copy's shape is static, the row count is not), so no CTA
  writes a token it does not own. Zero tiles (padding tokens) load nothing and store zeros; the slack
  tiles of the static count (no tokens) do nothing.

Configs (``RaggedConfig``): ``block_kv = 64`` and 2 stages by default (~104 KB of shared memory at
``D = 128``: two CTAs share an SM, one's softmax runs while the other's wgmma does); ``block_kv = 128``
(wider N, half the steps, ~176 KB). Two warpgroups sharing one ring were tried and lost on the H200
(docs/benchmarks.md).

Constraints of the Mosaic GPU lowering and its interpreter (as in paged_decode_attention_mgpu.py):
wgmma's M is 64; shared memory for wgmma is tiled ``(8, 64)`` and 128-byte swizzled, so a head's ``TQ``
query rows are a multiple of 8 (``G <= 8``); the interpreter cannot store into a wgmma accumulator, run
wgmma under ``pl.run_state`` or take wgmma's A operand from registers, so each wgmma gets a fresh zero
accumulator (``pl.run_scoped``), the rescaled ``O`` is carried in registers and ``P`` goes through
shared memory. A TMA-only producer warpgroup beside two compute warpgroups (FlashAttention-3's layout,
jax's ``attention_mgpu.py``) deadlocked the interpreter on a 2-core machine: three warpgroups blocked at
barriers at once hold every XLA:CPU worker thread. On the CPU (tests) the kernel runs in Mosaic GPU's
interpreter (``interpret=True``); lowering for CUDA on any backend checks the real lowering short of
PTX.
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

from pallas_kernels.mgpu_common import check_bf16_paged_attention, one_kernel_per_shape

__all__ = ["META_FIELDS", "RaggedConfig", "num_tiles", "ragged_paged_attention_mgpu", "tile_schedule"]

LANES = 64  # query lanes per warpgroup: wgmma's M
_NEG = -1e30  # finite "minus infinity": exp2(_NEG - _NEG) = 1, not NaN, for a lane with no key yet
_LOG2E = math.log2(math.e)
# Per work tile: the row (for its block table), the first query token and their count, the window's
# first token in units of 8 rows, the position of the window's first token in the row, the tile's key count.
META_FIELDS = ("row", "q0", "qn", "window_8", "window_pos", "num_keys")
_ROW_TILE = 8  # shared memory's row tiling: a TMA copy into a tiled buffer starts on a multiple of it


@dataclasses.dataclass(frozen=True)
class RaggedConfig:
    """The kernel's key tile (``block_kv`` keys per pipeline step: wgmma's N for the scores, its K for
    ``P V``) and pipeline depth (``max_concurrent_steps`` key tiles of shared memory per CTA)."""

    max_concurrent_steps: int = 2
    block_kv: int = 64


def num_tiles(num_tokens: int, num_rows: int, tile_tokens: int) -> int:
    """The static tile count that any step of ``num_tokens`` tokens in ``num_rows`` rows fits: row ``i``
    (and the padding pseudo-row) needs ``cdiv(o_i + q_len_i, tile_tokens)`` tiles, ``o_i <= 7`` its
    offset in its 8-aligned first window."""
    return -(-(num_tokens + (_ROW_TILE - 1) * (num_rows + 1)) // tile_tokens) + num_rows + 1


def tile_schedule(query_start_loc, seq_lens, num_seqs, *, num_tokens: int, num_rows: int, tile_tokens: int,
                  max_context: int):
    """``int32[N, 6]``, one line of ``META_FIELDS`` per work tile, ``N = num_tiles(num_tokens, num_rows,
    tile_tokens)`` (the module docstring). Row ``i < num_seqs``'s tokens are cut at the windows
    ``a_i + j * tile_tokens`` (``a_i`` its first token rounded down to a multiple of 8), then come the
    padding tokens ``[qsl[num_seqs], num_tokens)`` as zero tiles (no keys), then empty tiles (no tokens);
    ordered by key count, longest first. ``num_tokens`` and ``tile_tokens`` are multiples of 8 and
    ``num_tokens >= tile_tokens``, so every window ``[window, window + tile_tokens)`` lies inside ``q``."""
    R, T, TQ = num_rows, num_tokens, tile_tokens
    qsl = jnp.clip(query_start_loc.astype(jnp.int32), 0, T)
    ns = jnp.clip(jnp.asarray(num_seqs, jnp.int32), 0, R)
    idx = jnp.arange(R + 1, dtype=jnp.int32)  # the rows, then the padding pseudo-row (index num_seqs)
    real = idx < ns
    start = jnp.where(idx <= ns, qsl[idx], T)
    end = jnp.where(real, qsl[jnp.minimum(idx + 1, R)], T)
    end = jnp.where(idx <= ns, jnp.maximum(end, start), start)
    aligned = start // _ROW_TILE * _ROW_TILE
    tiles = jnp.where(end > start, (end - aligned + TQ - 1) // TQ, 0)
    first = jnp.cumsum(tiles) - tiles
    t = jnp.arange(num_tiles(T, R, TQ), dtype=jnp.int32)
    # The last row whose first tile is <= t: an empty row shares its first tile with the next row.
    row = jnp.clip(jnp.searchsorted(first, t, side="right", method="compare_all") - 1, 0, R)
    window = aligned[row] + (t - first[row]) * TQ
    q0 = jnp.maximum(start[row], window)
    qn = jnp.clip(jnp.minimum(end[row], window + TQ) - q0, 0, TQ)
    window = jnp.where(qn > 0, jnp.minimum(window, T - TQ), 0)
    q0 = jnp.where(qn > 0, q0, 0)
    is_real = real[row] & (qn > 0)
    ctx = jnp.where(is_real, jnp.clip(seq_lens.astype(jnp.int32)[jnp.minimum(row, R - 1)], 0, max_context), 0)
    window_pos = ctx - (end[row] - start[row]) + (window - start[row])
    num_keys = jnp.where(is_real, jnp.clip(window_pos + (q0 - window) + qn, 0, ctx), 0)
    meta = jnp.stack([jnp.minimum(row, R - 1), q0, qn, window // _ROW_TILE, window_pos, num_keys], axis=1)
    order = jnp.argsort(-num_keys, stable=True)
    return meta[order]


def _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, config: RaggedConfig) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    check_bf16_paged_attention(q, k_cache, v_cache)
    _, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, block_size, _ = k_cache.shape
    if num_q_heads % num_kv_heads or num_q_heads // num_kv_heads not in (1, 2, 4, 8):
        raise ValueError(f"G = Hq / Hkv must be 1, 2, 4 or 8 (a head's query rows are a multiple of the 8-row "
                         f"tiling); got Hq = {num_q_heads}, Hkv = {num_kv_heads}")
    if head_dim % 64:
        raise ValueError(f"head_dim = {head_dim} must be a multiple of 64 (the 128-byte swizzle)")
    if config.block_kv not in (64, 128):
        raise ValueError(f"block_kv = {config.block_kv} must be 64 or 128")
    if block_size % 8 or (config.block_kv % block_size and block_size % config.block_kv):
        raise ValueError(f"block_size = {block_size} must be a multiple of 8 that divides block_kv = "
                         f"{config.block_kv} or that it divides")
    num_rows = block_tables.shape[0] if block_tables.ndim == 2 else -1
    if block_tables.ndim != 2 or seq_lens.shape != (num_rows,) or query_start_loc.shape != (num_rows + 1,):
        raise ValueError(f"block_tables [R, max_blocks], seq_lens [R] and query_start_loc [R + 1] disagree: "
                         f"{tuple(block_tables.shape)}, {tuple(seq_lens.shape)}, {tuple(query_start_loc.shape)}")
    if config.max_concurrent_steps < 1:
        raise ValueError(f"max_concurrent_steps = {config.max_concurrent_steps} must be positive")


def _tile_setup(layer_gmem, meta_gmem, bt_gmem, *, group, max_blocks, num_blocks, block_size, block_kv):
    """What the kernel starts from: the CTA's head, ``tq``, its tile's ``(q0, qn, window, window_pos,
    num_keys)`` (the window's first token as a multiple of the row tiling, as the Q copies' lowering must
    see), its key-tile count and an ``issue(step, slot, rings)`` for its TMA ring."""
    tile_id, head = lax.axis_index("tile"), lax.axis_index("head")
    row, q0, qn, window_8, window_pos, num_keys = (meta_gmem[tile_id * len(META_FIELDS) + f]
                                                   for f in range(len(META_FIELDS)))
    meta = (q0, qn, window_8 * _ROW_TILE, window_pos, num_keys)
    issue = functools.partial(_issue_kv, row=row, layer=layer_gmem[0], head=head, bt_gmem=bt_gmem,
                              max_blocks=max_blocks, num_blocks=num_blocks, block_size=block_size, block_kv=block_kv)
    return head, LANES // group, meta, lax.div(num_keys + block_kv - 1, block_kv), issue


def _issue_kv(step, slot, caches, *, row, layer, head, bt_gmem, max_blocks, num_blocks, block_size, block_kv):
    """TMA copies of key tile ``step``'s pages into stage ``slot`` of each ``(gmem, smem, barrier)`` in
    ``caches`` (K, V or both); every copy arrives on the stage's barrier."""
    pages_per_tile, page_rows = max(1, block_kv // block_size), min(block_size, block_kv)
    for j in range(pages_per_tile):
        if block_size <= block_kv:
            page, offset = step * pages_per_tile + j, 0
        else:
            page, offset = lax.div(step * block_kv, block_size), lax.rem(step * block_kv, block_size)
        blk = jnp.clip(bt_gmem[row * max_blocks + jnp.minimum(page, max_blocks - 1)], 0, num_blocks - 1)
        for gmem, smem, bar in caches:
            plgpu.copy_gmem_to_smem(gmem.at[layer, blk, head, pl.ds(offset, page_rows)],
                                    smem.at[slot, pl.ds(j * page_rows, page_rows)], bar.at[slot])


def _load_queries(q_gmem, q_smem, q_bar, *, window, head, group, tq):
    """One TMA copy per query head of the KV head: tokens ``[window, window + tq)`` into rows ``g * tq``."""
    for g in range(group):
        plgpu.copy_gmem_to_smem(q_gmem.at[pl.ds(window, tq), head * group + g], q_smem.at[pl.ds(g * tq, tq)], q_bar)


def _scores(q_smem, k_tile):
    """``Q K^T`` for one key tile, one wgmma into a fresh accumulator (the interpreter's constraint)."""
    def run(s_ref):
        plgpu.wgmma(s_ref, q_smem, k_tile.T)
        plgpu.wgmma_wait(0)
        return s_ref[...]

    return pl.run_scoped(run, plgpu.ACC((LANES, k_tile.shape[0]), jnp.float32))


def _softmax_step(s, position, first_key, m_i, l_i, *, scale_log2):
    """Causal mask (``key <= position`` per lane) and the online softmax of one key tile in base 2:
    ``(p, alpha, m_new, l_new)``."""
    key = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
    s = jnp.where(key + first_key <= position, s * scale_log2, _NEG)
    m_new = jnp.maximum(m_i, s.max(axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    return p, alpha, m_new, l_i * alpha + p.sum(axis=1)


def _zero_dead_values(v_tile, n_live):
    """Zeroes the tile's values past its ``n_live`` keys: their p is 0, but 0 * a stale NaN is NaN."""
    v = plgpu.load(v_tile, layout=plgpu.Layout.WGMMA)
    key_row = plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=plgpu.Layout.WGMMA)
    v_tile[...] = jnp.where(key_row < n_live, v, jnp.zeros_like(v))
    plgpu.commit_smem()


def _values(p_smem, v_tile, head_dim):
    """``P V`` for one key tile, one wgmma into a fresh accumulator."""
    def run(o_ref):
        plgpu.wgmma(o_ref, p_smem, v_tile)
        plgpu.wgmma_wait(0)
        return o_ref[...]

    return pl.run_scoped(run, plgpu.ACC((LANES, head_dim), jnp.float32))


def _initial_carry(head_dim):
    return (plgpu.layout_cast(jnp.zeros((LANES, head_dim), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((LANES,), _NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            plgpu.layout_cast(jnp.zeros((LANES,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))


def _store_output(acc, l_i, o_smem, out_gmem, *, window, q0, qn, head, group, tq):
    """``O / l`` in bf16 through ``o_smem``; the lanes' tokens ``[window, window + tq)`` that are the
    tile's (``[q0, q0 + qn)``) go out, per head."""
    l_safe = jnp.where(l_i > 0, l_i, 1.0)  # zero tiles and junk lanes: no key, output 0
    o_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(o_smem.dtype)
    plgpu.commit_smem()
    first = jnp.maximum(q0, window)
    count = jnp.clip(jnp.minimum(q0 + qn, window + tq) - first, 0, tq)
    for g in range(group):
        _store_rows(o_smem, out_gmem, g * tq + first - window, first, count, head * group + g, tq=tq)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _kernel(layer_gmem, meta_gmem, bt_gmem, q_gmem, k_gmem, v_gmem, out_gmem, *, group, max_blocks, num_blocks,
            block_size, block_kv, stages, scale_log2):
    """One CTA's work tile and KV head: its warpgroup issues the TMA ring and computes."""
    head, tq, (q0, qn, window, window_pos, num_keys), steps, issue = _tile_setup(
        layer_gmem, meta_gmem, bt_gmem, group=group, max_blocks=max_blocks, num_blocks=num_blocks,
        block_size=block_size, block_kv=block_kv)
    head_dim = q_gmem.shape[-1]
    pages_per_tile = max(1, block_kv // block_size)

    def work(q_smem, k_smem, v_smem, p_smem, o_smem, q_bar, k_bar, v_bar):
        k_ring, v_ring = (k_gmem, k_smem, k_bar), (v_gmem, v_smem, v_bar)

        @pl.when(steps > 0)  # a zero tile (padding tokens) only stores zeros
        def _start():
            _load_queries(q_gmem, q_smem, q_bar, window=window, head=head, group=group, tq=tq)
            for i in range(stages):
                pl.when(i < steps)(functools.partial(issue, i, i, (k_ring, v_ring)))
            plgpu.barrier_wait(q_bar)

        lane = plgpu.broadcasted_iota(jnp.int32, (LANES, block_kv), 0, layout=plgpu.Layout.WGMMA)
        position = window_pos + lax.rem(lane, tq)

        def kv_step(step, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(k_bar.at[slot])
            s = _scores(q_smem, k_smem.at[slot])
            refill = step + stages < steps  # the stage's K is read: refill it now, its V after P V
            pl.when(refill)(functools.partial(issue, step + stages, slot, (k_ring,)))
            p, alpha, m_i, l_i = _softmax_step(s, position, step * block_kv, m_i, l_i, scale_log2=scale_log2)
            p_smem[...] = p.astype(p_smem.dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_bar.at[slot])
            n_live = num_keys - step * block_kv
            pl.when(n_live < block_kv)(functools.partial(_zero_dead_values, v_smem.at[slot], n_live))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + _values(p_smem, v_smem.at[slot], head_dim)
            pl.when(refill)(functools.partial(issue, step + stages, slot, (v_ring,)))
            return acc, m_i, l_i

        acc, _, l_i = lax.fori_loop(0, steps, kv_step, _initial_carry(head_dim))
        _store_output(acc, l_i, o_smem, out_gmem, window=window, q0=q0, qn=qn, head=head, group=group, tq=tq)

    def body(*refs):
        pl.when(qn > 0)(functools.partial(work, *refs))  # the slack tiles of the static count: no tokens

    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    pl.run_scoped(
        body,
        plgpu.SMEM((LANES, head_dim), jnp.bfloat16, transforms=swizzled),
        plgpu.SMEM((stages, block_kv, head_dim), jnp.bfloat16, transforms=swizzled),
        plgpu.SMEM((stages, block_kv, head_dim), jnp.bfloat16, transforms=swizzled),
        plgpu.SMEM((LANES, block_kv), jnp.bfloat16, transforms=swizzled),
        plgpu.SMEM((LANES, head_dim), jnp.bfloat16),
        plgpu.Barrier(num_arrivals=group),
        plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=stages),
        plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=stages),
    )


def _store_rows(o_smem, out_gmem, smem_row, token, count, q_head, *, tq):
    """Rows ``smem_row .. smem_row + count`` of ``o_smem`` to tokens ``token ..`` of ``q_head``: a ladder
    of TMA copies of ``2^j`` rows, one for each bit of ``count`` (``0 <= count <= tq``)."""
    done = 0
    size = 1 << (tq.bit_length() - 1)
    while size >= 1:
        @pl.when(count & size != 0)
        def _copy(start=smem_row + done, dst=token + done, size=size):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, size)], out_gmem.at[pl.ds(dst, size), q_head])

        done = done + (count & size)
        size //= 2


@one_kernel_per_shape("sm_scale", "sliding_window", "config", "interpret")
def ragged_paged_attention_mgpu(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, num_seqs, *,
                                sm_scale, sliding_window=None, config: RaggedConfig | None = None,
                                interpret=False):
    """Attention of a ragged batch of query tokens over the paged KV cache (the module docstring).

    Args:
      q: ``[T, Hq, D]`` bf16.
      k_cache, v_cache: ``[num_layers, num_blocks, Hkv, block_size, D]`` bf16.
      layer: int32 scalar, may be traced (the ``lax.scan`` index).
      block_tables: ``int32[R, max_blocks]``; seq_lens: ``int32[R]``; query_start_loc: ``int32[R + 1]``.
      num_seqs: int32 scalar, the number of real rows.
      sm_scale: softmax scale, a static Python float.
      sliding_window: must be None (not supported here; ragged_paged_attention takes it).
      config: the key tile and pipeline depth; ``RaggedConfig()`` when None.
      interpret: run Mosaic GPU's interpreter on the CPU (CPU tests): ``True`` for its default
        ``plgpu.InterpretGPUParams()``, or such an instance.

    Returns:
      ``[T, Hq, D]`` bf16; the padding tokens ``[qsl[num_seqs], T)`` are 0.
    """
    if sliding_window is not None:
        raise ValueError("ragged_paged_attention_mgpu has no sliding window: use ragged_paged_attention")
    config = config or RaggedConfig()
    _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, config)
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    num_rows, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    tile_tokens = LANES // group
    if num_tokens == 0:
        return q
    padded = max(-(-num_tokens // _ROW_TILE) * _ROW_TILE, tile_tokens)
    q_in = q if padded == num_tokens else jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, 0)))
    meta = tile_schedule(query_start_loc, seq_lens, num_seqs, num_tokens=padded, num_rows=num_rows,
                         tile_tokens=tile_tokens, max_context=max_blocks * block_size)
    max_tiles = -(-max_blocks * block_size // config.block_kv)
    stages = max(1, min(config.max_concurrent_steps, max_tiles))
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    kernel = plgpu.kernel(
        functools.partial(_kernel, group=group, max_blocks=max_blocks, num_blocks=num_blocks, block_size=block_size,
                          block_kv=config.block_kv, stages=stages, scale_log2=float(sm_scale) * _LOG2E),
        out_type=jax.ShapeDtypeStruct((padded, num_q_heads, head_dim), jnp.bfloat16),
        grid=(meta.shape[0], num_kv_heads),
        grid_names=("tile", "head"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret or None,
        kernel_name="ragged_paged_attention_mgpu",
    )
    out = kernel(jnp.asarray(layer, jnp.int32).reshape(1), meta.reshape(-1), block_tables.astype(jnp.int32).reshape(-1),
                 q_in, k_cache, v_cache)
    return out[:num_tokens]
