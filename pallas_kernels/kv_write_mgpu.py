"""Write this step's K/V into the stacked paged KV cache (Pallas, Mosaic GPU backend).

``write_kv_mgpu`` has exactly ``kv_write.write_kv``'s contract (issue 27 moves the kernels off
the deprecated Triton backend); ``kv_write.write_kv_reference`` is the reference of both.

Layout (docs/architecture.md): each cache is ``[num_layers, num_blocks, num_kv_heads,
block_size, head_dim]``. Token ``t`` with ``slot = slot_mapping[t] >= 0`` goes to block
``slot // block_size``, offset ``slot % block_size``; ``slot == -1`` is a padding token and
writes nothing.

Algorithm. One CTA (one warpgroup, 128 threads) per ``block_t`` consecutive tokens; the grid is
``(cdiv(T, block_t),)``. The CTA first loads, for each of its tokens, the slot and the token's
``[num_kv_heads, head_dim]`` tile of new K and of new V (contiguous in ``k_new/v_new``) from
global memory into registers, all loads before any store so that they are in flight together.
Then, for each token whose slot is valid (and that is not past ``T``), it stores the tiles to
``cache[layer, block, :, offset, :]``: ``num_kv_heads`` rows of ``head_dim`` contiguous
elements, ``block_size * head_dim`` elements apart. Loads and stores go straight between global
memory and registers (the warpgroup-strided layout: each thread moves a few contiguous elements,
so a warp's accesses coalesce within each row); there is no shared memory, no TMA and no barrier.
The tail CTA's tokens past ``T`` read token ``T - 1`` (every read stays in bounds) and store
nothing.

Why not TMA: a token's destination is ``num_kv_heads`` separate rows, and a CTA's tokens land in
unrelated blocks, so TMA would stage each tile through shared memory and issue one copy per token
with barriers around it; the register path moves the same bytes with plain coalesced accesses.

The update is in place: the caches enter the kernel as mutable refs (``jax.new_ref``), which
Pallas turns into kernel operands aliased to its outputs, so with the caller donating the
caches (the jitted step donates them, or they are the carry of the ``lax.scan`` over layers) XLA
writes into the existing buffers and copies nothing. ``layer`` is a traced int32 scalar (the scan
index), passed as a 1-element array in global memory like the slots.

Constraints of the Mosaic GPU lowering: ``num_kv_heads * head_dim`` must be a multiple of 128
(the warpgroup's threads share each tile evenly), which every real model's KV heads satisfy; and
the cast to the cache dtype must be one Mosaic GPU emits (between bf16, f16 and f32, the dtypes
the engine's caches use; bf16 -> fp8 is refused at lowering).

On the CPU (tests) the kernel runs in Mosaic GPU's interpreter (``interpret=True``), which
checks every read against the buffers' bounds but not the real lowering's layouts or alignment.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kv_write import _check_shapes

__all__ = ["write_kv_mgpu"]

_WARPGROUP = 128  # CUDA threads of one Mosaic GPU thread (a warpgroup)


def _write_kv_kernel(
    layer_ref, slot_ref, k_new_ref, v_new_ref, k_ref, v_ref, *, num_tokens, block_size, block_t
):
    base = lax.axis_index("t") * block_t
    layer = layer_ref[0]
    # All of the CTA's loads first, so that they overlap; the tail's out-of-range tokens re-read
    # token T - 1 and are masked off below.
    tokens = []
    for j in range(block_t):
        t = jnp.minimum(base + j, num_tokens - 1)
        tokens.append((base + j, slot_ref[t], k_new_ref[t], v_new_ref[t]))
    for t, slot, k, v in tokens:

        @pl.when((t < num_tokens) & (slot >= 0))
        def _store():
            block = lax.div(slot, block_size)
            offset = lax.rem(slot, block_size)
            k_ref[layer, block, :, offset, :] = k.astype(k_ref.dtype)
            v_ref[layer, block, :, offset, :] = v.astype(v_ref.dtype)


def write_kv_mgpu(
    k_cache,
    v_cache,
    k_new,
    v_new,
    slot_mapping,
    layer,
    *,
    interpret=False,
    block_t=4,
):
    """Scatters ``k_new/v_new [T, Hkv, D]`` into layer ``layer`` of the caches, in place.

    Same contract as ``kv_write.write_kv``. Call it inside the jitted step (or a ``jax.jit``
    that donates the caches); called eagerly, XLA has to copy the caches because nothing
    donates them.

    Args:
      k_cache, v_cache: ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]``.
        Donate them in the caller for a true in-place update.
      k_new, v_new: ``[T, num_kv_heads, head_dim]`` (cast to the cache dtype).
      slot_mapping: ``int32[T]``; ``-1`` marks padding tokens, which write nothing.
      layer: int32 scalar (may be traced, e.g. the ``lax.scan`` index over layers).
      interpret: run Mosaic GPU's interpreter on the CPU (CPU tests): ``True`` for its default
        ``plgpu.InterpretGPUParams()``, or such an instance.
      block_t: tokens per CTA.

    Returns:
      The updated ``(k_cache, v_cache)``; slots not written keep their old values.
    """
    _check_shapes(k_cache, v_cache, k_new, v_new, slot_mapping)
    _, _, num_kv_heads, block_size, head_dim = k_cache.shape
    num_tokens = k_new.shape[0]
    if (num_kv_heads * head_dim) % _WARPGROUP:
        raise ValueError(
            f"num_kv_heads * head_dim = {num_kv_heads} * {head_dim} must be a multiple of {_WARPGROUP}"
        )
    if block_t < 1:
        raise ValueError(f"block_t={block_t} must be positive")
    if num_tokens == 0:
        return k_cache, v_cache
    if interpret is True:
        # Mosaic GPU's own interpreter: Pallas' generic one cannot run the grid's axis_index.
        interpret = plgpu.InterpretGPUParams()

    kernel = plgpu.kernel(
        functools.partial(_write_kv_kernel, num_tokens=num_tokens, block_size=block_size, block_t=block_t),
        out_type=(),
        grid=(pl.cdiv(num_tokens, block_t),),
        grid_names=("t",),
        # No shared memory and no thread reads what another writes: Pallas' automatic barriers
        # around loads and stores would only add a warpgroup barrier per store.
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True),
        interpret=interpret,
        kernel_name="write_kv_mgpu",
    )
    # Mutable refs: the kernel writes them, so Pallas aliases them to its outputs (no copy).
    k_ref, v_ref = jax.new_ref(k_cache), jax.new_ref(v_cache)
    kernel(jnp.asarray(layer, jnp.int32).reshape(1), slot_mapping.astype(jnp.int32), k_new, v_new, k_ref, v_ref)
    return jax.freeze(k_ref), jax.freeze(v_ref)
