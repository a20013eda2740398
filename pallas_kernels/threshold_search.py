"""The sampler's slow path as Pallas kernels (Triton backend) whose rows can be skipped one by
one; mrv2_jax/sample/slow_path.py says why, and its jnp counterparts are the k-ary searches of
mrv2_jax/sample/topk_topp.py (same thresholds: the tests compare them).

Why the Triton backend: a streaming pass over each row with no matrix product, whose speed is the
rate of its loads. Mosaic GPU reaches global memory through TMA copies into shared memory, which
streamed one-row weights more slowly than plain wide loads into registers (docs/benchmarks.md,
sessions 50 and 51); a Mosaic GPU port of this pass is not measured.

Both kernels have one program per row (grid (R,)), which does nothing but write a neutral value
when its row is not `needed`, and otherwise loops over the row in tiles of `tile_blocks` blocks:

``row_mass``: sum of exp(scaled - row_max) over the tokens with scaled >= floor, where scaled =
x / divisor (top_p's total above a min_p floor).

``threshold_search``: the row's top_k threshold (its k-th largest scaled value), then top_p's
on the tokens at or above max(floor, that). Each is a radix select over the 2**32 float bit
patterns, mapped to keys with the floats' order: 16 passes, each fixing the next two bits of
the answer, the largest key whose count (top_k) or mass (top_p: the sum of exp(scaled -
row_max)) of tokens at or above it still reaches the target. The three candidates of a pass
share one read of the row. Counts are exact; masses are f32 sums in one fixed order (tiles in
sequence, each tile reduced the same way), so they grow with the set summed and the search is
exact for them too. The answer is a token's key, so the threshold is that token's value.

Both scale by multiplying with the reciprocal the sampler uses (sampler_common.reciprocal), so that
their thresholds compare exactly with the sampler's scaled values.

Keys are int32 with the floats' order (negative bit patterns have their other 31 bits flipped;
topk_topp's jnp search uses the same order as uint32). The search runs over unsigned positions
(the key with its sign bit flipped), built two bits at a time with shifts and ors only, so
nothing overflows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.sampler_common import check_int32_size, reciprocal, row_tile, scale_rows

SIGN = -(2**31)  # int32 with only the sign bit set
LOW_BITS = 2**31 - 1
BITS_PER_PASS = 2


def _ordered_key(x):
    """f32 -> int32 with the same order (-0.0 and +0.0 get one key)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
    return jnp.where(bits < 0, bits ^ LOW_BITS, bits)


def _position_to_float(position):
    """Inverse of (ordered key ^ SIGN)."""
    key = position ^ SIGN
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ LOW_BITS, key), jnp.float32)


def _largest_position(value_at, target):
    """The largest unsigned position t (as int32 bits) with value_at(key t) >= target, where
    value_at(keys: list of int32 scalars) -> one value per key, non-increasing in the key, and
    value_at(lowest key) >= target."""
    digits = range(1, 2**BITS_PER_PASS)

    def one_pass(i, found):
        shift = 32 - BITS_PER_PASS * (i + 1)
        positions = [found | jnp.left_shift(jnp.int32(d), shift) for d in digits]
        values = value_at([p ^ SIGN for p in positions])
        for p, v in zip(positions, values):  # a prefix of the digits qualifies: keep the last
            found = jnp.where(v >= target, p, found)
        return found

    return jax.lax.fori_loop(0, 32 // BITS_PER_PASS, one_pass, jnp.int32(0))


def _over_row(vocab_size, tile_blocks, tile_fn, init):
    """Fold tile_fn(ids, in_row, carry) over the row's tiles, in order."""
    num_tiles = pl.cdiv(pl.cdiv(vocab_size, 128), tile_blocks)

    def body(c, carry):
        _, _, ids, in_row = row_tile(vocab_size, tile_blocks, c)
        return tile_fn(ids, in_row, carry)

    return jax.lax.fori_loop(0, num_tiles, body, init)


def _mass_kernel(x_ref, inverse_ref, row_max_ref, floor_ref, needed_ref, out_ref, *, vocab_size, tile_blocks):
    r = pl.program_id(0)
    out_ref[r] = inverse_ref[r] * 0.0  # 0, made from a loaded value (see noise_pass.py)

    @pl.when(needed_ref[r] != 0)
    def _mass():
        inverse, row_max, floor = inverse_ref[r], row_max_ref[r], floor_ref[r]

        def tile(ids, in_row, total):
            scaled = pltriton.load(x_ref.at[r * vocab_size + ids], mask=in_row, other=0) * inverse
            return total + jnp.sum(jnp.where(in_row & (scaled >= floor), jnp.exp(scaled - row_max), 0.0))

        out_ref[r] = _over_row(vocab_size, tile_blocks, tile, jnp.float32(0))


def _search_kernel(x_ref, inverse_ref, row_max_ref, floor_ref, k_ref, p_ref, needed_ref, out_ref, *,
                   vocab_size, tile_blocks):
    r = pl.program_id(0)
    V = vocab_size
    out_ref[r] = floor_ref[r]

    @pl.when(needed_ref[r] != 0)
    def _search():
        inverse, row_max, k, p = inverse_ref[r], row_max_ref[r], k_ref[r], p_ref[r]

        def load_scaled(ids, in_row):
            return pltriton.load(x_ref.at[r * V + ids], mask=in_row, other=0) * inverse

        def count_at(keys):
            def tile(ids, in_row, counts):
                key = _ordered_key(load_scaled(ids, in_row))
                return tuple(n + jnp.sum((in_row & (key >= c)).astype(jnp.int32)) for n, c in zip(counts, keys))

            return _over_row(V, tile_blocks, tile, (jnp.int32(0),) * len(keys))

        def top_k():
            return _position_to_float(_largest_position(count_at, jnp.clip(k, 1, V)))

        floor = floor_ref[r]
        floor = jax.lax.cond((k > 0) & (k < V), lambda: jnp.maximum(floor, top_k()), lambda: floor)

        def e_of(ids, in_row):
            scaled = load_scaled(ids, in_row)
            return scaled, jnp.where(in_row & (scaled >= floor), jnp.exp(scaled - row_max), 0.0)

        def mass_at(keys):
            # Tokens are chosen by their scaled value's key, not by e's: e may round differently
            # in different passes (the compiler may fuse the scaling into exp's argument), which
            # must not move a token across a candidate.
            def tile(ids, in_row, masses):
                scaled, e = e_of(ids, in_row)
                key = _ordered_key(scaled)
                return tuple(m + jnp.sum(jnp.where(key >= c, e, 0.0)) for m, c in zip(masses, keys))

            return _over_row(V, tile_blocks, tile, (jnp.float32(0),) * len(keys))

        def top_p():  # the largest value (a token's) such that the tokens at or above it hold mass p
            total = _over_row(V, tile_blocks, lambda ids, in_row, s: s + jnp.sum(e_of(ids, in_row)[1]),
                              jnp.float32(0))
            return jnp.maximum(_position_to_float(_largest_position(mass_at, p * total)), floor)

        out_ref[r] = jax.lax.cond(p < 1, top_p, lambda: floor)


def _row_call(kernel, name, r, interpret, num_warps, num_stages):
    return pl.pallas_call(kernel, grid=(r,), out_shape=jax.ShapeDtypeStruct((r,), jnp.float32),
                          interpret=interpret, name=name,
                          compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages))


def row_mass_reference(x: jax.Array, divisor: jax.Array, row_max: jax.Array, floor: jax.Array,
                       needed: jax.Array) -> jax.Array:
    """What row_mass computes, in jnp over every row (f32 sums in XLA's order, not the kernel's)."""
    scaled = scale_rows(x.astype(jnp.float32), divisor)
    mass = jnp.sum(jnp.where(scaled >= floor[:, None], jnp.exp(scaled - row_max[:, None]), 0.0), axis=-1)
    return jnp.where(needed, mass, 0.0)


# The launch defaults (64 blocks, 8 warps, 3 stages) are the fastest that `bench threshold_search`
# measured (docs/benchmarks.md, "The search kernel").
@functools.partial(jax.jit, static_argnames=("interpret", "tile_blocks", "num_warps", "num_stages"))
def row_mass(x: jax.Array, divisor: jax.Array, row_max: jax.Array, floor: jax.Array, needed: jax.Array, *,
             interpret: bool = False, tile_blocks: int = 64, num_warps: int = 8, num_stages: int = 3) -> jax.Array:
    """x [R, V] -> f32[R]: sum of exp(x / divisor - row_max) over x / divisor >= floor at the
    `needed` rows (others: 0)."""
    r, v = x.shape
    check_int32_size(x)
    kernel = functools.partial(_mass_kernel, vocab_size=v, tile_blocks=tile_blocks)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    return _row_call(kernel, "row_mass", r, interpret, num_warps, num_stages)(
        f32(x).reshape(-1), reciprocal(divisor), f32(row_max), f32(floor), needed.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("interpret", "tile_blocks", "num_warps", "num_stages"))
def threshold_search(x: jax.Array, divisor: jax.Array, row_max: jax.Array, floor: jax.Array, k: jax.Array,
                     p: jax.Array, needed: jax.Array, *, interpret: bool = False, tile_blocks: int = 64,
                     num_warps: int = 8, num_stages: int = 3) -> jax.Array:
    """x [R, V]; for scaled = x / divisor (row maxima row_max) -> f32[R]: at the `needed` rows,
    the top_k threshold (k outside (0, V): none) raised to `floor`, then top_p's (p >= 1:
    none) over the tokens at or above it; others: floor."""
    r, v = x.shape
    check_int32_size(x)
    kernel = functools.partial(_search_kernel, vocab_size=v, tile_blocks=tile_blocks)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    return _row_call(kernel, "threshold_search", r, interpret, num_warps, num_stages)(
        f32(x).reshape(-1), reciprocal(divisor), f32(row_max), f32(floor), k.astype(jnp.int32), f32(p),
        needed.astype(jnp.int32))

