"""The top n entries of each row of a wide array, exactly, without sorting whole rows.

`lax.top_k` over a 152K-wide row runs as a full sort on the GPU for n > 16 (~3.4 ms for
256 rows on an H200). Block maxima narrow the work to n small blocks instead:

  1. cut each row into blocks of `block` ids and take every block's maximum (one fused pass);
  2. keep the n blocks with the largest maxima (a top_k over R x V/block values);
  3. the top n of the row lie inside those n blocks: top_k over their n * block values.

Why 3 holds, ties included (order: larger value first, then lower id, as lax.top_k): every
kept block holds its maximum, an element that comes before any element of a block that was
not kept (a dropped block's maximum is no larger, and at equal maxima the kept block has the
lower block index, hence lower ids). That makes n elements in front of everything in the
dropped blocks, so none of those is in the top n.

Step 3 is itself a top n over a row (n * block wide, its ids still increasing along it), so the
narrowing repeats with smaller blocks: `blocks=(128, 16)` keeps n blocks of 128, then n
sub-blocks of 16 among them, and sorts n * 16 values at the end. On an H200 (256 rows, n = 64)
the one sort over 64 x 128 candidates took 128 us of a 1.2 ms sampler call; docs/benchmarks.md
("Sampler: fewer conditionals") has the split after the second level.
"""

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_BLOCKS = (128, 16)


def top_n_by_blocks(x: jax.Array, n: int, blocks: tuple[int, ...] = DEFAULT_BLOCKS,
                    block_max: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Same result as `jax.lax.top_k(x, n)` for x [R, V]: (values [R, n], ids i32[R, n]).

    block_max [R, ceil(V / blocks[0])]: the maxima of x's first-level blocks, when the caller
    has them already (sample/logit_stats.py computes them in the pass that writes x)."""
    return top_n_of_each([(x, block_max)], n, blocks)[0]


def top_n_of_each(parts, n: int, blocks: tuple[int, ...] = DEFAULT_BLOCKS) -> list[tuple[jax.Array, jax.Array]]:
    """top_n_by_blocks of several arrays (x [R_i, V_i], block_max or None) at once: after the
    first level they are stacked along the rows, so each later top_k and sort runs once for all
    of them (on an H200 each is a kernel of 3-20 us whose time barely depends on the rows).
    Values come back as f32 when the inputs' dtypes differ."""
    narrowed = [_narrow(x, None, n, blocks[0], block_max) for x, block_max in parts]
    rows = [values.shape[0] for values, _ in narrowed]
    dtype = jnp.result_type(*(values.dtype for values, _ in narrowed))
    widths = {values.shape[1] for values, _ in narrowed}
    if len(narrowed) > 1 and len(widths) > 1:  # unequal widths: no stacking
        return [_finish(values, ids, n, blocks[1:]) for values, ids in narrowed]
    values = jnp.concatenate([v.astype(dtype) for v, _ in narrowed])
    ids = None if narrowed[0][1] is None else jnp.concatenate([i for _, i in narrowed])
    top_values, top_ids = _finish(values, ids, n, blocks[1:])
    bounds = np.cumsum([0, *rows])
    return [(top_values[a:b], top_ids[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def _finish(values, ids, n: int, blocks):
    for block in blocks:
        values, ids = _narrow(values, ids, n, block)
    top_values, pos = jax.lax.top_k(values, n)
    top_ids = pos if ids is None else jnp.take_along_axis(ids, pos, axis=1)
    return top_values, top_ids.astype(jnp.int32)


def _narrow(values, ids, n: int, block: int, block_max=None):
    """One level: keep the n blocks of `block` entries with the largest maxima (ids None: the
    column index) -> (values [R, n * block], ids), or the input when it has <= n blocks."""
    r, m = values.shape
    num_blocks = -(-m // block)
    if num_blocks <= n:  # nothing to narrow at this level
        return values, ids
    pad = num_blocks * block - m
    values = jnp.pad(values, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(r, num_blocks, block)
    maxima = jnp.max(values, axis=-1) if block_max is None else block_max
    _, best = jax.lax.top_k(maxima, n)  # [R, n]
    best = jnp.sort(best, axis=-1)  # kept in id order, so equal values keep lower ids first
    if ids is None:
        # Padding gets ids past the row: after every real id, so it loses every tie.
        ids = best[:, :, None] * block + jnp.arange(block, dtype=best.dtype)
    else:
        ids = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=jnp.iinfo(jnp.int32).max)
        ids = jnp.take_along_axis(ids.reshape(r, num_blocks, block), best[:, :, None], axis=1)
    values = jnp.take_along_axis(values, best[:, :, None], axis=1).reshape(r, n * block)
    return values, ids.reshape(r, n * block)
