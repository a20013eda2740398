"""Write this step's K/V into the stacked paged KV cache (Pallas, Triton backend).

Why the Triton backend: the Mosaic GPU port (kv_write_mgpu.py) is correct but measured slower at
decode sizes and no faster at prefill sizes (docs/benchmarks.md, "KV write on Mosaic GPU"), so the
engine keeps this kernel.

Layout (docs/architecture.md): each cache is ``[num_layers, num_blocks, num_kv_heads,
block_size, head_dim]``. Token ``t`` with ``slot = slot_mapping[t] >= 0`` goes to block
``slot // block_size``, offset ``slot % block_size``; ``slot == -1`` is a padding token and
writes nothing.

Algorithm. The cache is viewed as a 2-D array of rows, one row per (layer, block, kv head,
offset), each row ``head_dim`` contiguous elements:

    row = ((layer * num_blocks + block) * num_kv_heads + head) * block_size + offset

(a free reshape of the contiguous array). The grid is ``(cdiv(T, BLOCK_T), num_kv_heads)``;
program ``(i, h)`` loads the ``[BLOCK_T, head_dim]`` tile of new K (and V) for tokens
``i*BLOCK_T ...`` and head ``h`` and scatters it, one contiguous ``head_dim`` row per token,
to the rows above with a masked store. Padding tokens (and the tail past ``T``) are masked
off; they also get an out-of-range row index so that the interpret-mode emulation of the
masked store (a scatter that writes the old value back under the mask) can never collide
with a real write.

The update is in place: the pallas_call aliases the cache inputs to its outputs
(``input_output_aliases``), so with the caller donating the cache (the jitted step donates
it, or the cache is the carry of the ``lax.scan`` over layers) XLA writes into the existing
buffer and copies nothing. ``layer`` is a traced int32 scalar (the scan index), passed to
the kernel as a 1-element array because Triton has no scalar prefetch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["write_kv", "write_kv_reference"]


def _check_shapes(k_cache, v_cache, k_new, v_new, slot_mapping):
    if k_cache.shape != v_cache.shape or k_cache.ndim != 5:
        raise ValueError(f"bad cache shapes {k_cache.shape} {v_cache.shape}")
    if k_new.shape != v_new.shape or k_new.ndim != 3:
        raise ValueError(f"bad new K/V shapes {k_new.shape} {v_new.shape}")
    _, _, num_kv_heads, _, head_dim = k_cache.shape
    if k_new.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"k_new {k_new.shape} does not match cache {k_cache.shape}")
    if slot_mapping.shape != (k_new.shape[0],):
        raise ValueError(f"slot_mapping {slot_mapping.shape} vs {k_new.shape[0]} tokens")


def _write_kv_kernel(
    layer_ref,
    slot_ref,
    k_new_ref,
    v_new_ref,
    k_in_ref,
    v_in_ref,
    k_out_ref,
    v_out_ref,
    *,
    num_tokens,
    num_blocks,
    num_kv_heads,
    block_size,
    block_t,
):
    del k_in_ref, v_in_ref  # Aliased to the outputs; all access goes through those.
    head_dim = k_new_ref.shape[-1]
    head = pl.program_id(1)
    t = pl.program_id(0) * block_t + jnp.arange(block_t, dtype=jnp.int32)
    in_range = t < num_tokens
    t = jnp.minimum(t, num_tokens - 1)  # keep every address in bounds
    slot = pltriton.load(slot_ref.at[t], mask=in_range, other=-1)
    valid = in_range & (slot >= 0)
    slot = jnp.maximum(slot, 0)
    block = lax.div(slot, block_size)
    offset = lax.rem(slot, block_size)
    row = ((layer_ref[0] * num_blocks + block) * num_kv_heads + head) * block_size + offset
    # Masked-off lanes point one past the last row: never dereferenced on the GPU, and
    # dropped by the interpret-mode scatter, so they cannot overwrite a real write.
    num_rows = k_out_ref.shape[0]
    row = jnp.where(valid, row, num_rows)

    d = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    src = (t * num_kv_heads + head)[:, None]
    mask = jnp.broadcast_to(valid[:, None], (block_t, head_dim))
    k = pltriton.load(k_new_ref.at[src, d], mask=mask, other=0)
    v = pltriton.load(v_new_ref.at[src, d], mask=mask, other=0)
    pltriton.store(k_out_ref.at[row[:, None], d], k.astype(k_out_ref.dtype), mask=mask)
    pltriton.store(v_out_ref.at[row[:, None], d], v.astype(v_out_ref.dtype), mask=mask)


def write_kv(
    k_cache,
    v_cache,
    k_new,
    v_new,
    slot_mapping,
    layer,
    *,
    interpret=False,
    block_t=16,
    num_warps=4,
    num_stages=1,
):
    """Scatters ``k_new/v_new [T, Hkv, D]`` into layer ``layer`` of the caches, in place.

    Call it inside the jitted step (or a ``jax.jit`` that donates the caches); called
    eagerly, XLA has to copy the caches because nothing donates them.

    Args:
      k_cache, v_cache: ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]``.
        Donate them in the caller for a true in-place update.
      k_new, v_new: ``[T, num_kv_heads, head_dim]`` (cast to the cache dtype).
      slot_mapping: ``int32[T]``; ``-1`` marks padding tokens, which write nothing.
      layer: int32 scalar (may be traced, e.g. the ``lax.scan`` index over layers).
      interpret: run the Pallas interpreter (CPU tests).
      block_t: tokens per program (power of two).

    Returns:
      The updated ``(k_cache, v_cache)``; slots not written keep their old values.
    """
    _check_shapes(k_cache, v_cache, k_new, v_new, slot_mapping)
    num_layers, num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    num_tokens = k_new.shape[0]
    if head_dim & (head_dim - 1) or block_t & (block_t - 1):
        raise ValueError(f"head_dim={head_dim} and block_t={block_t} must be powers of two")
    num_rows = num_layers * num_blocks * num_kv_heads * block_size
    if num_rows >= 2**31:
        raise ValueError("cache has >= 2**31 rows; int32 row indices would overflow")
    if num_tokens == 0:
        return k_cache, v_cache

    kernel = functools.partial(
        _write_kv_kernel,
        num_tokens=num_tokens,
        num_blocks=num_blocks,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        block_t=block_t,
    )
    rows_shape = jax.ShapeDtypeStruct((num_rows, head_dim), k_cache.dtype)
    k_rows, v_rows = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_tokens, block_t), num_kv_heads),
        out_shape=(rows_shape, rows_shape),
        # Inputs: layer, slot, k_new, v_new, k_cache (4), v_cache (5).
        input_output_aliases={4: 0, 5: 1},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="write_kv",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        slot_mapping.astype(jnp.int32),
        k_new.reshape(num_tokens * num_kv_heads, head_dim),
        v_new.reshape(num_tokens * num_kv_heads, head_dim),
        k_cache.reshape(num_rows, head_dim),
        v_cache.reshape(num_rows, head_dim),
    )
    return k_rows.reshape(k_cache.shape), v_rows.reshape(v_cache.shape)


def write_kv_reference(
    k_cache, v_cache, k_new, v_new, slot_mapping, layer, *, interpret=False, **unused_tuning
):
    """Pure-jnp ``write_kv``: one scatter per cache; padding slots go out of range and drop."""
    del interpret, unused_tuning
    _check_shapes(k_cache, v_cache, k_new, v_new, slot_mapping)
    num_blocks, block_size = k_cache.shape[1], k_cache.shape[3]
    valid = slot_mapping >= 0
    block = jnp.where(valid, slot_mapping // block_size, num_blocks)  # out of range: dropped
    offset = jnp.where(valid, slot_mapping % block_size, 0)
    # Advanced indices (layer, block, offset) around a slice: the indexed shape is
    # [T, num_kv_heads, head_dim], exactly k_new's.
    k_cache = k_cache.at[layer, block, :, offset, :].set(k_new.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[layer, block, :, offset, :].set(v_new.astype(v_cache.dtype), mode="drop")
    return k_cache, v_cache
