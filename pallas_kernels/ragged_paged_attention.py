"""Ragged paged attention over the stacked paged KV cache (Pallas, Triton backend).

Why the Triton backend: the Mosaic GPU kernel for mixed prefill and decode rows
(ragged_paged_attention_mgpu.py, ``--kernels ragged_attention=mgpu``) is faster on prompt rows but
slower on decode rows, which most mixed steps are full of: in the engine it was even with this one at
S2 and slower at S1@256 (docs/benchmarks.md, sessions 38-39). On decode rows alone this kernel
reads the cache as fast as either Mosaic GPU kernel by device time (at copy bandwidth at 4K tokens of
context), and fused decode with the decode-only one (paged_decode_attention_mgpu.py) was even at 1
and 8 rows and slower at 32 and 256 (sessions 49 and 68). This stays the default until one measures
faster. The split-K merge kernel below is Triton too: it gathers a
few kilobytes of this kernel's partials per call, the size at which the Mosaic GPU port of the KV
write measured slower than its Triton kernel (kv_write.py); no Mosaic GPU merge was tried.

One call serves a whole step's batch: prefill chunks (many query tokens of a row, causal
within the chunk and over the row's earlier cached context) mixed with decodes (one query
token, or a few for speculative decoding). The metadata is the step's (docs/architecture.md):
row ``i`` owns query tokens ``q[qsl[i]:qsl[i+1]]`` at positions ``seq_lens[i] - q_len + j``,
and its keys are positions ``0 .. seq_lens[i]-1`` of its pages ``block_tables[i]``. This
step's K/V are already in the cache (``write_kv`` or ``qk_norm_rope_kv_write`` runs first).

Layout inside the kernel. Both caches are viewed as 2-D ``[rows, head_dim]`` (a free reshape)
where ``row = ((layer*num_blocks + block)*num_kv_heads + kv_head)*block_size + offset``: each
key is one contiguous ``head_dim`` row and a page's ``[block_size, head_dim]`` tile per KV head
is contiguous, so a tile of BLOCK_N keys is loaded as BLOCK_N/block_size runs of contiguous
memory. Keys are gathered per token through ``block_tables`` (``page = pos // block_size``),
so BLOCK_N need not equal the block size. The whole page pool is passed to the kernel (no
BlockSpec tiling; Triton has no scalar prefetch), and all indexing is explicit pointer
arithmetic on these rows.

Tiling (the "unified attention" scheme). A program owns one *query tile*: BLOCK_Q consecutive
query tokens of a single row times the G = Hq/Hkv query heads that share one KV head, packed
into the M = BLOCK_M = BLOCK_Q*G rows of the matmul (lane m = token m//G, head m%G), so the
KV tile is loaded once for all G heads and M >= 16 as tl.dot requires. Row ``i``'s tiles get
the consecutive tile indices starting at ``qsl[i] // BLOCK_Q + i``; these starts strictly
increase and row ``i`` needs ``cdiv(q_len_i, BLOCK_Q)`` of them, which never overlap row
``i+1``'s start. Hence ``cdiv(T, BLOCK_Q) + R`` tiles always suffice, a *static* count, and
a program finds its row by a binary search over ``qsl`` inside the kernel. Tiles past a
row's last query (and the slack at the end of the grid) find no work and only do the search.
The padding tokens ``[qsl[num_seqs], T)`` are handled as a pseudo-row ``num_seqs`` with no
keys, whose tiles write zeros: the output holds **zeros for every padding token**, and
padded rows (``i >= num_seqs``) own no tokens.

Grid: ``(cdiv(T, BLOCK_Q) + R, num_kv_heads, num_kv_splits)``, tiles visited last-first so
that the causally longest tiles start first. Each program runs an online (flash) softmax
over the BLOCK_N-key chunks of its tile's key range ``[lo, hi)``, where ``hi`` is the last
query's position + 1 (causal) and ``lo`` is 0 or the sliding-window start. Chunks that every
query of the tile sees in full are processed without any mask (the bulk of a long context);
only the chunks that straddle the causal diagonal or the window edge pay for the mask.

Split-K (flash decoding). A decode tile has a single query token and a long key range; one
program per (row, kv head) cannot fill 132 SMs at small batch. With ``num_kv_splits = S >
1``, the tile's chunk range is cut into S contiguous parts, one per program along grid axis
2; each writes its unnormalised partial (acc, running max, running sum) to f32 scratch
outputs, and a merge (a small kernel for buckets of a few tokens, else a jnp epilogue XLA
fuses) combines the S partials with the usual log-sum-exp rescaling into q's dtype. Every
(split, token, head) partial is written (empty splits write acc=0, sum=0), so the merge reads
no uninitialised memory. S is static; the default picks S from the static shapes (more splits
when there are few rows); the runner can pass its own.

``ragged_paged_attention_reference`` is the pure-jnp version (gather each row's pages, dense
masked softmax); it is also the fallback and the GPU baseline.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference", "default_tuning"]

# Finite "minus infinity": masked logits and the initial running max. Being finite keeps
# exp2(NEG - NEG) = 1 instead of NaN for rows that have seen no visible key yet; their
# garbage is wiped by the exp2(NEG - real_max) = 0 rescale once a visible key arrives.
_NEG = -1e30
_LOG2E = math.log2(math.e)
_TARGET_PROGRAMS = 528  # ~4 programs per SM on an H200 (132 SMs), for the split heuristic
_SMALL_BUCKET_TOKENS = 8  # a bucket of at most this many tokens gets decode tiles whatever its rows


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc):
    if q.ndim != 3 or k_cache.ndim != 5 or k_cache.shape != v_cache.shape:
        raise ValueError(f"bad shapes q={q.shape} k={k_cache.shape} v={v_cache.shape}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[4] != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"q {q.shape} does not match cache {k_cache.shape}")
    num_rows = block_tables.shape[0]
    if num_rows < 1 or block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [R >= 1, max_blocks], got {block_tables.shape}")
    if seq_lens.shape != (num_rows,) or query_start_loc.shape != (num_rows + 1,):
        raise ValueError(
            f"metadata shapes: block_tables {block_tables.shape}, seq_lens "
            f"{seq_lens.shape}, query_start_loc {query_start_loc.shape}"
        )


# ----------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------


def _rpa_kernel(
    layer_ref,
    bt_ref,
    seq_lens_ref,
    qsl_ref,
    num_seqs_ref,
    q_ref,
    k_ref,
    v_ref,
    *out_refs,
    num_tokens,
    num_rows,
    max_blocks,
    num_blocks,
    num_q_heads,
    num_kv_heads,
    block_size,
    block_m,
    block_q,
    block_n,
    num_splits,
    scale_log2,
    window,
):
    T, R, G, BQ, BN = num_tokens, num_rows, num_q_heads // num_kv_heads, block_q, block_n
    head_dim = q_ref.shape[-1]
    # The Triton lowering runs f32 dots in TF32 unless asked for HIGHEST (IEEE f32).
    precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
    # Tiles run in reverse order: with causal prefill the last tiles of a row have the most
    # keys, and starting the longest programs first shortens the tail of the launch.
    tile = pl.num_programs(0) - 1 - pl.program_id(0)
    kv_head, split = pl.program_id(1), pl.program_id(2)

    # --- Which row owns this tile: the largest r in [0, num_seqs] with
    # qsl[r] // BQ + r <= tile (r == num_seqs is the padding pseudo-row).
    num_seqs = jnp.minimum(jnp.maximum(num_seqs_ref[0], 0), R)

    def search_step(_, lo_hi):
        lo, hi = lo_hi
        mid = lax.div(lo + hi + 1, 2)
        ok = lax.div(qsl_ref[mid], BQ) + mid <= tile
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    row, _ = lax.fori_loop(0, R.bit_length(), search_step, (jnp.int32(0), num_seqs))
    is_real = row < num_seqs
    q_start = qsl_ref[row]
    q_end = jnp.where(is_real, qsl_ref[jnp.minimum(row + 1, R)], T)
    q_len = q_end - q_start
    ctx_len = jnp.where(is_real, seq_lens_ref[jnp.minimum(row, R - 1)], 0)
    tile_q0 = (tile - (lax.div(q_start, BQ) + row)) * BQ  # first query of the tile in its row
    n_valid = jnp.minimum(jnp.maximum(q_len - tile_q0, 0), BQ)  # 0 for idle programs

    # --- The tile's queries: lane m is token m // G, query head kv_head*G + m % G.
    lane = jnp.arange(block_m, dtype=jnp.int32)
    lane_tok = lax.div(lane, G)
    lane_valid = lane_tok < n_valid  # also false for lanes >= BQ*G when G does not divide M
    q_tok = jnp.minimum(q_start + tile_q0 + lane_tok, T - 1)
    q_row = q_tok * num_q_heads + kv_head * G + lax.rem(lane, G)
    d = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    lane_mask = jnp.broadcast_to(lane_valid[:, None], (block_m, head_dim))
    q = pltriton.load(q_ref.at[q_row[:, None], d], mask=lane_mask, other=0)
    q_pos = ctx_len - q_len + tile_q0 + lane_tok  # [M]

    # --- Key range of the tile, in BLOCK_N chunks: [c_lo, c_hi).
    pos_first = ctx_len - q_len + tile_q0
    pos_last = pos_first + n_valid - 1
    kv_hi = jnp.where(n_valid > 0, jnp.maximum(pos_last + 1, 0), 0)
    c_hi = lax.div(kv_hi + BN - 1, BN)
    if window is None:
        c_lo = jnp.int32(0)
        c_full_lo = c_lo
    else:
        c_lo = jnp.minimum(lax.div(jnp.maximum(pos_first - window + 1, 0), BN), c_hi)
        # First chunk whose keys are all inside the window of the tile's *last* query.
        c_full_lo = lax.div(jnp.maximum(pos_last - window + 1, 0) + BN - 1, BN)
        c_full_lo = jnp.minimum(jnp.maximum(c_full_lo, c_lo), c_hi)
    # Chunks before c_full_hi end at or before the tile's *first* query: no causal mask.
    c_full_hi = lax.div(jnp.maximum(pos_first + 1, 0), BN)
    c_full_hi = jnp.minimum(jnp.maximum(c_full_hi, c_full_lo), c_hi)

    # This program's share of the chunks (split-K).
    per_split = lax.div(c_hi - c_lo + num_splits - 1, num_splits)
    s_lo = jnp.minimum(c_lo + split * per_split, c_hi)
    s_hi = jnp.minimum(s_lo + per_split, c_hi)

    bt_row = jnp.minimum(row, R - 1) * max_blocks
    cache_row0 = (layer_ref[0] * num_blocks) * num_kv_heads + kv_head

    def pages(chunk):
        """The page of each key of a chunk (clamped to the row's table: a chunk past it reads a real entry)."""
        kv = chunk * BN + jnp.arange(BN, dtype=jnp.int32)
        return pltriton.load(bt_ref.at[bt_row + jnp.minimum(lax.div(kv, block_size), max_blocks - 1)])

    def attend(chunk, carry, masked, blk=None):
        acc, m_i, l_i = carry
        kv = chunk * BN + jnp.arange(BN, dtype=jnp.int32)
        if masked:
            kv_ok = kv < kv_hi
            page = jnp.minimum(lax.div(kv, block_size), max_blocks - 1)
            blk = pltriton.load(bt_ref.at[bt_row + page], mask=kv_ok, other=0)
        kv_row = (cache_row0 + blk * num_kv_heads) * block_size + lax.rem(kv, block_size)
        if masked:
            kv_mask = jnp.broadcast_to(kv_ok[:, None], (BN, head_dim))
            k = pltriton.load(k_ref.at[kv_row[:, None], d], mask=kv_mask, other=0)
            v = pltriton.load(v_ref.at[kv_row[:, None], d], mask=kv_mask, other=0)
        else:
            k = pltriton.load(k_ref.at[kv_row[:, None], d])
            v = pltriton.load(v_ref.at[kv_row[:, None], d])

        s = pltriton.dot(q, k, trans_b=True, precision=precision) * scale_log2  # log2 domain
        if masked:
            visible = (kv[None, :] <= q_pos[:, None]) & kv_ok[None, :]
            if window is not None:
                visible &= kv[None, :] > q_pos[:, None] - window
            s = jnp.where(visible, s, _NEG)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l_i = l_i * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v, precision=precision)
        return acc, m_new, l_i

    carry = (
        jnp.zeros((block_m, head_dim), jnp.float32),
        jnp.full((block_m,), _NEG, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
    )
    masked_body = functools.partial(attend, masked=True)
    if window is not None:  # chunks cut by the window's lower edge
        carry = lax.fori_loop(s_lo, jnp.minimum(c_full_lo, s_hi), masked_body, carry)
    # The unmasked chunks (every key < kv_hi <= seq_len) read their pages one chunk ahead: the K/V
    # loads then depend on nothing loaded in their own iteration, which is what lets Triton's pipeliner
    # keep num_stages - 1 chunks of K and V in flight (with the table read in the same iteration it
    # keeps one buffer and waits for it before every chunk, whatever num_stages says).
    def attend_unmasked(chunk, carry_and_pages):
        *carry, blk = carry_and_pages
        return (*attend(chunk, carry, masked=False, blk=blk), pages(chunk + 1))

    unmasked_lo = jnp.maximum(c_full_lo, s_lo)
    *carry, _ = lax.fori_loop(unmasked_lo, jnp.minimum(c_full_hi, s_hi), attend_unmasked,
                              (*carry, pages(unmasked_lo)))
    carry = tuple(carry)
    carry = lax.fori_loop(jnp.maximum(c_full_hi, s_lo), s_hi, masked_body, carry)
    acc, m_i, l_i = carry

    # Masked-off lanes get a row one past the end: the GPU never touches it, and the
    # interpreter's emulation of a masked store (a scatter that writes the old value back
    # under the mask) drops it instead of racing with the lane that owns the row.
    out_row = jnp.where(lane_valid, q_row, T * num_q_heads)
    if num_splits == 1:
        (o_ref,) = out_refs
        # l_i == 0 only for the padding pseudo-row, whose acc is 0: store zeros there.
        out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
        pltriton.store(o_ref.at[out_row[:, None], d], out.astype(o_ref.dtype), mask=lane_mask)
    else:
        o_ref, m_ref, l_ref = out_refs
        p_row = jnp.where(lane_valid, split * (T * num_q_heads) + q_row, o_ref.shape[0])
        pltriton.store(o_ref.at[p_row[:, None], d], acc, mask=lane_mask)
        pltriton.store(m_ref.at[p_row], m_i, mask=lane_valid)
        pltriton.store(l_ref.at[p_row], l_i, mask=lane_valid)


def default_tuning(num_tokens, num_rows, num_q_heads, num_kv_heads, max_context):
    """Static tuning defaults for a bucket: block_m, block_n, num_kv_splits, warps, stages.

    Decode-shaped buckets (at most one query token per row on average, or at most
    ``_SMALL_BUCKET_TOKENS`` tokens in all, such as one decode row padded to the smallest
    bucket) get small query tiles and enough KV splits to put ~4 programs on each SM;
    everything else gets prefill-sized tiles and no split. The runner may override any of
    them per bucket.
    """
    q_per_kv = num_q_heads // num_kv_heads
    decode_like = num_tokens <= max(num_rows, _SMALL_BUCKET_TOKENS)
    block_m = max(16 if decode_like else 64, _next_pow2(q_per_kv))
    block_n = 64
    splits = 1
    if decode_like:
        want = _next_pow2(pl.cdiv(_TARGET_PROGRAMS, max(1, num_rows * num_kv_heads)))
        splits = max(1, min(64, want, max_context // (2 * block_n)))  # >= 2 chunks per split
        splits = 1 << (splits.bit_length() - 1)
    return dict(block_m=block_m, block_n=block_n, num_kv_splits=splits, num_warps=4, num_stages=2)


def ragged_paged_attention(
    q,
    k_cache,
    v_cache,
    layer,
    block_tables,
    seq_lens,
    query_start_loc,
    num_seqs,
    *,
    sm_scale,
    sliding_window=None,
    interpret=False,
    block_m=None,
    block_n=None,
    num_kv_splits=None,
    num_warps=None,
    num_stages=None,
):
    """Attention of a ragged batch of query tokens over the paged KV cache.

    Args:
      q: ``[T, Hq, D]`` queries (T = padded token bucket). D must be a power of two.
      k_cache, v_cache: ``[num_layers, num_blocks, Hkv, block_size, D]``; Hq % Hkv == 0.
      layer: int32 scalar, may be traced (the ``lax.scan`` index).
      block_tables: ``int32[R, max_blocks_per_seq]``.
      seq_lens: ``int32[R]`` context lengths including this step's tokens.
      query_start_loc: ``int32[R + 1]``; padded rows repeat the last value.
      num_seqs: int32 scalar, number of real rows.
      sm_scale: softmax scale, a static Python float (e.g. ``D ** -0.5``).
      sliding_window: optional static int W: a query at p sees keys k with p - W < k <= p.
      interpret: run the Pallas interpreter (CPU tests).
      block_m: matmul rows per program (query tokens x G heads), power of two >= 16.
      block_n: keys per inner iteration, power of two >= 16.
      num_kv_splits: split-K factor (flash decoding), power of two.
      num_warps, num_stages: Triton launch parameters.
      (Tuning arguments left as None take ``default_tuning``'s value for these shapes.)

    Returns:
      ``[T, Hq, D]`` in q's dtype. Tokens ``t >= query_start_loc[num_seqs]`` (padding) are 0.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    T, num_q_heads, head_dim = q.shape
    num_layers, num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    R, max_blocks = block_tables.shape
    G = num_q_heads // num_kv_heads
    given = dict(
        block_m=block_m,
        block_n=block_n,
        num_kv_splits=num_kv_splits,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    cfg = default_tuning(T, R, num_q_heads, num_kv_heads, max_blocks * block_size)
    cfg.update({k: v for k, v in given.items() if v is not None})
    block_m, block_n, num_splits = cfg["block_m"], cfg["block_n"], cfg["num_kv_splits"]
    if not all(_is_pow2(x) for x in (head_dim, block_m, block_n, num_splits)):
        raise ValueError(
            f"head_dim={head_dim}, block_m={block_m}, block_n={block_n}, "
            f"num_kv_splits={num_splits} must be powers of two"
        )
    if block_m < 16 or block_n < 16 or head_dim < 16:
        raise ValueError("tl.dot needs block_m, block_n, head_dim >= 16")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if block_m < G:
        raise ValueError(f"block_m={block_m} must hold all {G} query heads of a KV head")
    num_cache_rows = num_layers * num_blocks * num_kv_heads * block_size
    if num_cache_rows >= 2**31:
        raise ValueError("cache has >= 2**31 rows; int32 row indices would overflow")
    if T == 0:
        return jnp.zeros_like(q)
    block_q = block_m // G
    num_tiles = pl.cdiv(T, block_q) + R

    kernel = functools.partial(
        _rpa_kernel,
        num_tokens=T,
        num_rows=R,
        max_blocks=max_blocks,
        num_blocks=num_blocks,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        block_m=block_m,
        block_q=block_q,
        block_n=block_n,
        num_splits=num_splits,
        scale_log2=float(sm_scale) * _LOG2E,
        window=None if sliding_window is None else int(sliding_window),
    )
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((T * num_q_heads, head_dim), q.dtype)
    else:
        n = num_splits * T * num_q_heads
        out_shape = (
            jax.ShapeDtypeStruct((n, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.float32),
        )
    outs = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads, num_splits),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        name="ragged_paged_attention",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        block_tables.astype(jnp.int32).reshape(-1),
        seq_lens.astype(jnp.int32),
        query_start_loc.astype(jnp.int32),
        jnp.asarray(num_seqs, jnp.int32).reshape(1),
        q.reshape(T * num_q_heads, head_dim),
        k_cache.reshape(num_cache_rows, head_dim),
        v_cache.reshape(num_cache_rows, head_dim),
    )
    if num_splits == 1:
        return outs.reshape(T, num_q_heads, head_dim)
    return _merge_splits(*outs, num_splits, q, interpret=interpret)


def _merge_kernel(acc_ref, m_ref, l_ref, o_ref, *, num_splits, num_rows):
    """One (token, q head) row: its S partials rescaled to the common max and summed."""
    head_dim = o_ref.shape[1]
    row = pl.program_id(0)
    split_rows = jnp.arange(num_splits, dtype=jnp.int32) * num_rows + row
    m = pltriton.load(m_ref.at[split_rows])
    l = pltriton.load(l_ref.at[split_rows])
    w = jnp.exp2(m - jnp.max(m))  # 0 for splits that saw no visible key
    l_sum = jnp.sum(w * l)
    acc = pltriton.load(acc_ref.at[split_rows[:, None], jnp.arange(head_dim, dtype=jnp.int32)[None, :]])
    out = jnp.sum(acc * w[:, None], axis=0)
    # l_sum == 0 only for padding tokens (their partials are 0 too): output 0.
    pltriton.store(o_ref.at[row, jnp.arange(head_dim, dtype=jnp.int32)],
                   (out / jnp.where(l_sum > 0, l_sum, 1.0)).astype(o_ref.dtype))


def _merge_splits(acc, m, l, num_splits, q, *, interpret=False):
    """Combines the split-K partials (acc, running max in log2 units, running sum) into q's shape
    and dtype. A bucket of at most _SMALL_BUCKET_TOKENS tokens merges in one small kernel (one
    program per token and q head); XLA makes two fusions of the jnp form, which is faster once there
    are more rows (docs/benchmarks.md, "The KV-split merge as a kernel")."""
    T, num_q_heads, head_dim = q.shape
    num_rows = T * num_q_heads
    if T > _SMALL_BUCKET_TOKENS:
        acc = acc.reshape(num_splits, T, num_q_heads, head_dim)
        m = m.reshape(num_splits, T, num_q_heads)
        l = l.reshape(num_splits, T, num_q_heads)
        w = jnp.exp2(m - jnp.max(m, axis=0))  # 0 for splits that saw no visible key
        l_sum = jnp.sum(w * l, axis=0)
        acc_sum = jnp.sum(w[..., None] * acc, axis=0)
        # l_sum == 0 only for padding tokens (acc_sum == 0 there too): output 0.
        return (acc_sum / jnp.where(l_sum > 0, l_sum, 1.0)[..., None]).astype(q.dtype)
    out = pl.pallas_call(
        functools.partial(_merge_kernel, num_splits=num_splits, num_rows=num_rows),
        grid=(num_rows,),
        out_shape=jax.ShapeDtypeStruct((num_rows, head_dim), q.dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4 if num_splits * head_dim <= 8192 else 8, num_stages=1),
        name="merge_kv_splits",
    )(acc, m, l)
    return out.reshape(q.shape)


# ----------------------------------------------------------------------------------------
# Pure-jnp reference (also the fallback and the GPU baseline)
# ----------------------------------------------------------------------------------------


def _token_metadata(T, block_tables, seq_lens, query_start_loc, num_seqs):
    """Per token: owning row, position, validity (t < qsl[num_seqs])."""
    R = block_tables.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    num_seqs = jnp.clip(jnp.asarray(num_seqs, jnp.int32), 0, R)
    valid = t < query_start_loc[num_seqs]
    # Largest row whose start is <= t; empty rows (repeated starts) are skipped over.
    row = jnp.clip(jnp.searchsorted(query_start_loc, t, side="right", method="scan_unrolled") - 1, 0, R - 1)
    q_len = query_start_loc[row + 1] - query_start_loc[row]
    pos = seq_lens[row] - q_len + (t - query_start_loc[row])
    return row, pos, valid


def _row_kv(cache, layer, block_tables, seq_lens):
    """[R, max_blocks * block_size, Hkv, D]: each row's pages gathered in order.

    Keys at or past seq_len are zeroed: whatever the cache holds there (stale or never
    written) must not reach the output, not even as 0 * NaN.
    """
    pages = cache[layer][block_tables]  # [R, MB, Hkv, bs, D]
    R, MB, H, bs, D = pages.shape
    kv = pages.transpose(0, 1, 3, 2, 4).reshape(R, MB * bs, H, D)
    live = jnp.arange(MB * bs)[None, :] < seq_lens[:, None]
    return jnp.where(live[:, :, None, None], kv, jnp.zeros((), kv.dtype))


def _visible(pos, key_pos, window):
    vis = key_pos <= pos
    if window is not None:
        vis &= key_pos > pos - window
    return vis


def _reference_per_token(q, k_rows, v_rows, row, pos, valid, sm_scale, window):
    """Each token gathers its row's keys: memory ~ T * S * Hkv * D (cheap for decode)."""
    T, Hq, D = q.shape
    Hkv = k_rows.shape[2]
    qg = q.reshape(T, Hkv, Hq // Hkv, D)
    k, v = k_rows[row], v_rows[row]  # [T, S, Hkv, D]
    s = (
        jnp.einsum(
            "thgd,tshd->thgs", qg, k, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST
        )
        * sm_scale
    )
    key_pos = jnp.arange(k.shape[1])
    vis = _visible(pos[:, None], key_pos[None, :], window) & valid[:, None]  # [T, S]
    s = jnp.where(vis[:, None, None, :], s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    p = jnp.where(vis[:, None, None, :], p, 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("thgs,tshd->thgd", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return jnp.where(valid[:, None, None, None], out, 0.0).reshape(T, Hq, D)


def _reference_per_row(q, k_rows, v_rows, row, pos, valid, query_start_loc, sm_scale, window):
    """Each row gathers its (up to T) queries: memory ~ R * T * S * Hq (cheap for prefill)."""
    T, Hq, D = q.shape
    R, S, Hkv, _ = k_rows.shape
    t = jnp.arange(T)
    # Scatter each token into slot (row, t - qsl[row]) of a [R, T] query grid.
    local = t - query_start_loc[row]
    grid_tok = (
        jnp.full((R, T), -1, jnp.int32).at[jnp.where(valid, row, R), local].set(t, mode="drop")
    )  # padding tokens go to row R: out of range, dropped
    grid_ok = grid_tok >= 0
    grid_pos = jnp.where(grid_ok, pos[jnp.maximum(grid_tok, 0)], -1)
    qg = q[jnp.maximum(grid_tok, 0)].reshape(R, T, Hkv, Hq // Hkv, D)
    s = (
        jnp.einsum(
            "rqhgd,rshd->rhgqs",
            qg,
            k_rows,
            preferred_element_type=jnp.float32,
            precision=lax.Precision.HIGHEST,
        )
        * sm_scale
    )
    vis = _visible(grid_pos[:, :, None], jnp.arange(S)[None, None, :], window)
    vis &= grid_ok[:, :, None]  # [R, Tq, S]
    s = jnp.where(vis[:, None, None], s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    p = jnp.where(vis[:, None, None], p, 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum(
        "rhgqs,rshd->rqhgd", p, v_rows.astype(jnp.float32), precision=lax.Precision.HIGHEST
    )  # [R, Tq, Hkv, G, D]
    out = out[row, jnp.clip(local, 0, T - 1)].reshape(T, Hq, D)
    return jnp.where(valid[:, None, None], out, 0.0)


def ragged_paged_attention_reference(
    q,
    k_cache,
    v_cache,
    layer,
    block_tables,
    seq_lens,
    query_start_loc,
    num_seqs,
    *,
    sm_scale,
    sliding_window=None,
    interpret=False,
    **unused_tuning,
):
    """Pure-jnp ``ragged_paged_attention`` (same signature; tuning kwargs are ignored).

    Gathers every row's pages into a dense ``[R, S, Hkv, D]`` context (S = max_blocks *
    block_size) and runs a masked softmax in f32. Two equivalent formulations, chosen from
    the static shapes so that neither decode nor prefill blows up: per token (each token
    gathers its row's keys; best when T is close to R) or per row (each row gathers a
    T-long query grid; best for a few long prefill rows). Padding tokens output 0.
    """
    del interpret, unused_tuning
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    T, Hq, D = q.shape
    R, MB = block_tables.shape
    Hkv, bs = k_cache.shape[2], k_cache.shape[3]
    window = None if sliding_window is None else int(sliding_window)
    row, pos, valid = _token_metadata(T, block_tables, seq_lens, query_start_loc, num_seqs)
    k_rows = _row_kv(k_cache, layer, block_tables, seq_lens)
    v_rows = _row_kv(v_cache, layer, block_tables, seq_lens)
    S = MB * bs
    per_token_cost = T * S * Hkv * D * 2  # the gathered K and V per token
    per_row_cost = R * T * S * Hq * 2  # logits and probabilities per (row, query slot)
    if per_token_cost <= per_row_cost:
        out = _reference_per_token(q, k_rows, v_rows, row, pos, valid, sm_scale, window)
    else:
        out = _reference_per_row(q, k_rows, v_rows, row, pos, valid, query_start_loc, sm_scale, window)
    return out.astype(q.dtype)
