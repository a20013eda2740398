"""The top n entries of each row of a wide array, exactly, without sorting whole rows.

`lax.top_k` over a 152K-wide row runs as a full sort on the GPU for n > 16, which at hundreds of
rows costs milliseconds (docs/benchmarks.md, "Sampler"). Block maxima narrow the work to n small
blocks instead:

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
sub-blocks of 16 among them, and sorts n * 16 values at the end; docs/benchmarks.md ("Sampler:
fewer conditionals") has what one level and two cost.
"""

import jax
import jax.numpy as jnp

DEFAULT_BLOCKS = (128, 16)


def top_n_by_blocks(x: jax.Array, n: int, blocks: tuple[int, ...] = DEFAULT_BLOCKS,
                    block_max: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Same result as `jax.lax.top_k(x, n)` for x [R, V]: (values [R, n], ids i32[R, n]).

    block_max [R, ceil(V / blocks[0])]: the maxima of x's first-level blocks, when the caller
    has them already (sample/logit_stats.py computes them in the pass that writes x)."""
    r = x.shape[0]
    values, ids = x, None  # ids None: the column index
    for level, block in enumerate(blocks):
        m = values.shape[1]
        num_blocks = -(-m // block)
        if num_blocks <= n:  # nothing to narrow at this level
            continue
        pad = num_blocks * block - m
        values = jnp.pad(values, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(r, num_blocks, block)
        maxima = block_max if level == 0 and block_max is not None else jnp.max(values, axis=-1)
        _, best = jax.lax.top_k(maxima, n)  # [R, n]
        best = jnp.sort(best, axis=-1)  # kept in id order, so equal values keep lower ids first
        if ids is None:
            # Padding gets ids past the row: after every real id, so it loses every tie.
            ids = best[:, :, None] * block + jnp.arange(block, dtype=best.dtype)
        else:
            ids = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=jnp.iinfo(jnp.int32).max)
            ids = jnp.take_along_axis(ids.reshape(r, num_blocks, block), best[:, :, None], axis=1)
        values = jnp.take_along_axis(values, best[:, :, None], axis=1).reshape(r, n * block)
        ids = ids.reshape(r, n * block)
    top_values, pos = jax.lax.top_k(values, n)
    top_ids = pos if ids is None else jnp.take_along_axis(ids, pos, axis=1)
    return top_values, top_ids.astype(jnp.int32)
