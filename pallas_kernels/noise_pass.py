"""The sampler's whole-row noise pass as a Pallas kernel (Triton backend) whose rows can be
skipped one by one, next to its pure-jnp reference; mrv2_jax/sample/noise_pass.py says why.

Why the Triton backend: a streaming pass over each row with no matrix product, whose speed is the
rate of its loads. Mosaic GPU reaches global memory through TMA copies into shared memory, which
streamed one-row weights more slowly than plain wide loads into registers (docs/benchmarks.md,
sessions 50 and 51); a Mosaic GPU port of this pass is not measured.

The pass: argmax over each row of (processed / divisor, cut below keep_from, plus the row's
Gumbel noise); greedy rows take the argmax of the processed logits.

Grid (R, cdiv(NB, tile_blocks)); program (r, c) does nothing but write an empty partial when row
r is not `needed`; otherwise it reads tile c of the row's processed logits and writes the tile's
maximum of (scaled, cut below keep_from, plus the row's Gumbel noise; greedy rows: the logits
as they are) and the lowest id holding it. The [R, C] partials are reduced outside.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.gumbel_hash import noise_from_key, row_key
from pallas_kernels.sampler_common import NEG_INF, check_int32_size, reciprocal, row_tile, scale_rows

NO_ID = jnp.iinfo(jnp.int32).max


def noise_pass_reference(x: jax.Array, divisor: jax.Array, keep_from: jax.Array, seeds: jax.Array,
                         positions: jax.Array, is_sampled: jax.Array, needed: jax.Array | None = None) -> jax.Array:
    """x f32[R, V] processed logits; divisor, keep_from f32[R]; seeds, positions i32[R];
    is_sampled bool[R] -> i32[R]: the pass at every row, or (needed given) at the `needed` rows
    and 0 at the others, as the kernel."""
    scaled = scale_rows(x, divisor)
    noisy = jnp.where(scaled >= keep_from[:, None], scaled, NEG_INF)
    ids = jnp.arange(x.shape[-1], dtype=jnp.uint32)[None, :]
    noisy = noisy + noise_from_key(row_key(seeds, positions)[:, None], ids)
    token = jnp.argmax(jnp.where(is_sampled[:, None], noisy, x), axis=-1).astype(jnp.int32)
    return token if needed is None else jnp.where(needed, token, 0)


def _noise_kernel(x_ref, inverse_ref, keep_ref, seeds_ref, positions_ref, sampled_ref, needed_ref,
                  best_ref, best_id_ref, *, vocab_size, tile_blocks):
    r, c = pl.program_id(0), pl.program_id(1)
    at = r * pl.num_programs(1) + c
    # The empty partial, -inf made from a loaded value: storing a bare -inf literal failed to
    # lower to Triton (jax 0.11.2: an OverflowError, the constant built as an integer).
    best_ref[at] = jnp.minimum(inverse_ref[r], NEG_INF)
    best_id_ref[at] = jnp.int32(NO_ID)

    @pl.when(needed_ref[r] != 0)
    def _pass():  # (program ids are read outside: the Pallas interpreter wants them there)
        _, _, ids, in_row = row_tile(vocab_size, tile_blocks, c)
        x = pltriton.load(x_ref.at[r * vocab_size + ids], mask=in_row, other=0)
        scaled = x * inverse_ref[r]  # as the sampler scales (sampler_common.reciprocal)
        noisy = jnp.where(scaled >= keep_ref[r], scaled, NEG_INF)
        noisy = noisy + noise_from_key(row_key(seeds_ref[r], positions_ref[r]), ids)
        values = jnp.where(in_row, jnp.where(sampled_ref[r] != 0, noisy, x), NEG_INF)
        best = jnp.max(values)
        best_ref[at] = best
        best_id_ref[at] = jnp.min(jnp.where(values == best, ids, NO_ID))


@functools.partial(jax.jit, static_argnames=("interpret", "tile_blocks", "num_warps"))
def noise_pass(x: jax.Array, divisor: jax.Array, keep_from: jax.Array, seeds: jax.Array, positions: jax.Array,
               is_sampled: jax.Array, needed: jax.Array, *, interpret: bool = False, tile_blocks: int = 32,
               num_warps: int = 4) -> jax.Array:
    """Same result as noise_pass_reference with `needed` -> i32[R]."""
    r, v = x.shape
    check_int32_size(x)
    programs = pl.cdiv(pl.cdiv(v, 128), tile_blocks)
    f32, i32 = jnp.float32, jnp.int32
    best, best_id = pl.pallas_call(
        functools.partial(_noise_kernel, vocab_size=v, tile_blocks=tile_blocks), grid=(r, programs),
        out_shape=(jax.ShapeDtypeStruct((r * programs,), f32), jax.ShapeDtypeStruct((r * programs,), i32)),
        interpret=interpret, compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name="noise_pass",
    )(x.astype(f32).reshape(-1), reciprocal(divisor), keep_from.astype(f32), seeds.astype(i32), positions.astype(i32),
      is_sampled.astype(i32), needed.astype(i32))
    best, best_id = best.reshape(r, programs), best_id.reshape(r, programs)
    top = jnp.max(best, axis=1, keepdims=True)
    token = jnp.min(jnp.where(best == top, best_id, NO_ID), axis=1)
    return jnp.where(needed, token, 0).astype(i32)
