"""From the fused q/k/v projection to attention-ready q and written K/V, in one kernel (Pallas,
Triton backend): per head, RMSNorm (q and k, optional), "halves" RoPE over the first rotary dims
(q and k), then q to its output and k, v into their slots of the stacked paged KV cache.

Why one kernel: at decode sizes each of these steps is a launch that moves a few kilobytes, so
the step's time is launch overhead; XLA makes five kernels of them plus the KV write
(docs/benchmarks.md, "q/k norm, RoPE and the KV write in one kernel"). Why the Triton backend:
the K/V rows scatter to arbitrary slots exactly as ``kv_write`` does, whose Mosaic GPU port was
measured slower at decode sizes (kv_write.py).

Layout. ``qkv [T, (H + 2 Hkv) * D]``: q heads, then k heads, then v heads, each ``D`` wide.
Program ``(i, h)`` of the grid ``(cdiv(T, BLOCK_T), H + Hkv)`` takes tokens ``i*BLOCK_T ...`` and
column block ``h``: a q head for ``h < H``, else k head ``h - H`` together with v head ``h - H``.
The cache is addressed as kv_write.py describes (rows of ``D`` elements, ``slot == -1`` writes
nothing) and updated in place (``input_output_aliases``; donate the caches in the caller).

Numerics follow the jnp reference below (and the Hugging Face code): the norm in float32, cast
back and scaled by its weight in the input dtype; the rotation in float32 on those values. The
rotation needs each element's partner ``d +- rotary_dim / 2``, which the program loads a second
time from the same row (an L1 hit) and normalizes with the same row scale.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kv_write import write_kv_reference

__all__ = ["qk_norm_rope_kv_write", "qk_norm_rope_kv_write_reference"]


def _check(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping, num_heads, norm_layer=None):
    if k_cache.shape != v_cache.shape or k_cache.ndim != 5:
        raise ValueError(f"bad cache shapes {k_cache.shape} {v_cache.shape}")
    _, _, num_kv_heads, _, head_dim = k_cache.shape
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.ndim != 2 or qkv.shape[1] != width:
        raise ValueError(f"qkv {qkv.shape}: expected [T, {width}] for {num_heads} q heads and the cache's "
                         f"{num_kv_heads} KV heads of {head_dim}")
    num_tokens = qkv.shape[0]
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {slot_mapping.shape} vs {num_tokens} tokens")
    if cos.shape != sin.shape or cos.shape[0] != num_tokens or not 0 < 2 * cos.shape[1] <= head_dim:
        raise ValueError(f"cos/sin {cos.shape}/{sin.shape}: expected [{num_tokens}, rotary_dim // 2] with "
                         f"rotary_dim <= {head_dim}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm: both or neither")
    if q_norm is None:
        return
    want = "(L, head_dim) with norm_layer" if norm_layer is not None else "(head_dim,)"
    if any(n.ndim != (1 if norm_layer is None else 2) or n.shape[-1] != head_dim for n in (q_norm, k_norm)):
        raise ValueError(f"norm weights {q_norm.shape}/{k_norm.shape}: expected {want}, head_dim {head_dim}")


def _kernel(layer_ref, norm_rows_ref, slot_ref, qkv_ref, q_norm_ref, k_norm_ref, cos_ref, sin_ref, k_in_ref, v_in_ref,
            q_out_ref, k_out_ref, v_out_ref, *, num_tokens, num_heads, num_kv_heads, num_blocks, block_size,
            block_t, eps, rotary_dim, has_norm):
    del k_in_ref, v_in_ref  # aliased to the outputs
    head_dim = q_norm_ref.shape[1]
    half = rotary_dim // 2
    h = pl.program_id(1)
    is_q = h < num_heads
    t = pl.program_id(0) * block_t + jnp.arange(block_t, dtype=jnp.int32)
    in_range = t < num_tokens
    t = jnp.minimum(t, num_tokens - 1)  # every address in bounds
    d = jnp.arange(head_dim, dtype=jnp.int32)
    partner = jnp.where(d < half, d + half, jnp.where(d < rotary_dim, d - half, d))
    rows = in_range[:, None] & (d >= 0)[None, :]  # [block_t, head_dim]

    x = pltriton.load(qkv_ref.at[t[:, None], (h * head_dim + d)[None, :]], mask=rows, other=0)
    xp = pltriton.load(qkv_ref.at[t[:, None], (h * head_dim + partner)[None, :]], mask=rows, other=0)
    dtype = x.dtype
    if has_norm:
        x32 = x.astype(jnp.float32)
        scale = lax.rsqrt(jnp.sum(x32 * x32, axis=1) / head_dim + eps)[:, None]
        q_row, k_row = norm_rows_ref[0], norm_rows_ref[norm_rows_ref.shape[0] - 1]  # one row or two
        weight = jnp.where(is_q, pltriton.load(q_norm_ref.at[q_row, d]), pltriton.load(k_norm_ref.at[k_row, d]))
        weight_p = jnp.where(is_q, pltriton.load(q_norm_ref.at[q_row, partner]),
                             pltriton.load(k_norm_ref.at[k_row, partner]))
        x = weight[None, :] * (x32 * scale).astype(dtype)
        xp = weight_p[None, :] * (xp.astype(jnp.float32) * scale).astype(dtype)
    # cos/sin of each element's pair; dims past rotary_dim keep their value (cos 1, sin 0).
    rotated = (d < rotary_dim)[None, :]
    pair = jnp.where(d < half, d, d - half) % half
    cos = pltriton.load(cos_ref.at[t[:, None], pair[None, :]], mask=rows, other=1)
    sin = pltriton.load(sin_ref.at[t[:, None], pair[None, :]], mask=rows, other=0)
    cos = jnp.where(rotated, cos, 1.0)
    sin = jnp.where(rotated, jnp.where((d < half)[None, :], -sin, sin), 0.0)
    out = (x.astype(jnp.float32) * cos + xp.astype(jnp.float32) * sin).astype(dtype)

    # q heads: rows t * H + h of q_out; masked-off lanes point one past the end (see kv_write.py).
    q_rows = q_out_ref.shape[0]
    q_row = jnp.where(in_range & is_q, t * num_heads + h, q_rows)
    pltriton.store(q_out_ref.at[q_row[:, None], d[None, :]], out.astype(q_out_ref.dtype),
                   mask=rows & is_q)

    # k heads: k and the v head of the same index into the token's slot.
    kv_head = jnp.maximum(h - num_heads, 0)
    slot = pltriton.load(slot_ref.at[t], mask=in_range, other=-1)
    valid = in_range & (slot >= 0) & jnp.logical_not(is_q)
    slot = jnp.maximum(slot, 0)
    block, offset = lax.div(slot, block_size), lax.rem(slot, block_size)
    cache_row = ((layer_ref[0] * num_blocks + block) * num_kv_heads + kv_head) * block_size + offset
    cache_row = jnp.where(valid, cache_row, k_out_ref.shape[0])
    kv_mask = valid[:, None] & (d >= 0)[None, :]
    v_col = (num_heads + num_kv_heads + kv_head) * head_dim + d
    v = pltriton.load(qkv_ref.at[t[:, None], v_col[None, :]], mask=kv_mask, other=0)
    pltriton.store(k_out_ref.at[cache_row[:, None], d[None, :]], out.astype(k_out_ref.dtype), mask=kv_mask)
    pltriton.store(v_out_ref.at[cache_row[:, None], d[None, :]], v.astype(v_out_ref.dtype), mask=kv_mask)


def qk_norm_rope_kv_write(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping, layer, *, num_heads,
                          eps=1e-6, norm_layer=None, interpret=False, block_t=16, num_warps=4):
    """q/k RMSNorm + halves RoPE + the KV write, from the fused projection.

    Args:
      qkv: ``[T, (num_heads + 2 Hkv) * D]``, the fused projection (bias added).
      q_norm, k_norm: ``[D]`` RMSNorm weights of every q / k head, or both None (no norm); or, with
        ``norm_layer``, stacked ``[L, D]`` weights read in place at row ``norm_layer`` (a slice of a
        stack handed to the kernel would be copied first).
      cos, sin: ``float32[T, rotary_dim // 2]``; dims past ``rotary_dim`` are not rotated.
      k_cache, v_cache: ``[num_layers, num_blocks, Hkv, block_size, D]``; donate them in the caller.
      slot_mapping: ``int32[T]``, ``-1`` for padding tokens (their q is computed, their K/V not written).
      layer: int32 scalar (may be traced), the cache's layer.
      norm_layer: int32 scalar (may be traced) or None, the norm weights' row (see above).

    Returns:
      ``(q [T, num_heads, D], k_cache, v_cache)``.
    """
    _check(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping, num_heads, norm_layer)
    num_layers, num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    num_tokens = qkv.shape[0]
    if num_tokens == 0:
        return jnp.zeros((0, num_heads, head_dim), qkv.dtype), k_cache, v_cache
    block_t = min(block_t, pl.next_power_of_2(num_tokens))
    if head_dim & (head_dim - 1) or block_t & (block_t - 1):
        raise ValueError(f"head_dim={head_dim} and block_t={block_t} must be powers of two")
    num_rows = num_layers * num_blocks * num_kv_heads * block_size
    if num_rows >= 2**31:
        raise ValueError("cache has >= 2**31 rows; int32 row indices would overflow")
    has_norm = q_norm is not None
    if not has_norm:  # the kernel reads no weights; ones keep its operands' shapes
        q_norm = k_norm = jnp.ones((head_dim,), qkv.dtype)
        norm_layer = None
    if norm_layer is None:
        # One [2, D] operand for both: a custom call copies each slice of a stacked weight it is
        # given, so two weights would cost two copies a layer; stacked, XLA makes them one fusion.
        both = jnp.stack([q_norm, k_norm]).astype(qkv.dtype)
        norm_operands, norm_rows = (both, both), jnp.array([0, 1], jnp.int32)
    else:
        # One row for both weights, not the row broadcast to two: XLA folds a constant layer index
        # to a literal but would launch a kernel to broadcast it.
        norm_operands = (q_norm.astype(qkv.dtype), k_norm.astype(qkv.dtype))
        norm_rows = jnp.asarray(norm_layer, jnp.int32).reshape(1)
    kernel = functools.partial(_kernel, num_tokens=num_tokens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                               num_blocks=num_blocks, block_size=block_size, block_t=block_t, eps=eps,
                               rotary_dim=2 * cos.shape[1], has_norm=has_norm)
    rows_shape = jax.ShapeDtypeStruct((num_rows, head_dim), k_cache.dtype)
    q, k_rows, v_rows = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_tokens, block_t), num_heads + num_kv_heads),
        out_shape=(jax.ShapeDtypeStruct((num_tokens * num_heads, head_dim), qkv.dtype), rows_shape, rows_shape),
        # Inputs: layer, norm rows, slot, qkv, q and k norm weights, cos, sin, k_cache (8), v_cache (9).
        input_output_aliases={8: 1, 9: 2},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name="qk_norm_rope_kv_write",
    )(jnp.asarray(layer, jnp.int32).reshape(1), norm_rows, slot_mapping.astype(jnp.int32), qkv, *norm_operands,
      cos.astype(jnp.float32), sin.astype(jnp.float32),
      k_cache.reshape(num_rows, head_dim), v_cache.reshape(num_rows, head_dim))
    return q.reshape(num_tokens, num_heads, head_dim), k_rows.reshape(k_cache.shape), v_rows.reshape(v_cache.shape)


def _norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    return weight.astype(x.dtype) * (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _rope_halves(x, cos, sin):
    rotary_dim = 2 * cos.shape[-1]
    x1 = x[..., : rotary_dim // 2].astype(jnp.float32)
    x2 = x[..., rotary_dim // 2 : rotary_dim].astype(jnp.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
    return jnp.concatenate([rotated, x[..., rotary_dim:]], axis=-1)


def qk_norm_rope_kv_write_reference(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping, layer, *,
                                    num_heads, eps=1e-6, norm_layer=None, interpret=False, **unused_tuning):
    """Pure-jnp ``qk_norm_rope_kv_write``: split, norm, rotate, then ``write_kv_reference``."""
    del interpret, unused_tuning
    _check(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping, num_heads, norm_layer)
    if q_norm is not None and norm_layer is not None:
        q_norm, k_norm = q_norm[norm_layer], k_norm[norm_layer]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[4]
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].reshape(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].reshape(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].reshape(num_tokens, num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = _norm(q, q_norm, eps), _norm(k, k_norm, eps)
    q, k = _rope_halves(q, cos, sin), _rope_halves(k, cos, sin)
    k_cache, v_cache = write_kv_reference(k_cache, v_cache, k, v, slot_mapping, layer)
    return q, k_cache, v_cache
