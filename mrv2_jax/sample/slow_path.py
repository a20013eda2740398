"""The threshold slow path: min_p / top_k / top_p cut-offs of the sampled rows that their top
candidates do not settle (sampler.threshold_and_top), found by reading the whole row.

Two whole-row pieces: top_p's mass above a min_p floor (rows with top_p and min_p but no top_k;
the block sums cannot tell it), then, for the rows that mass does not settle either, the
threshold search. Few rows of a real batch need them (top_k <= 64, or top_p on a peaked row,
finish on the top candidates), so the others must cost next to nothing, without a conditional
(features.py says why). SamplerKernels.slow_path picks how:

* "kernel" (GPUs) / "interpret" (CPU tests): two Pallas kernels (pallas_kernels/threshold_search.py),
  one program per row; programs of rows that need nothing exit at once. Their masses are f32
  sums in another order than XLA's: a top_p cut-off that falls within rounding of the boundary
  may differ by one token from the jnp search's, as it may from vLLM's.
* "reference": the jnp mass and k-ary searches (topk_topp.py) over every row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mrv2_jax.sample import topk_topp
from mrv2_jax.sample.features import SamplerFeatures
from pallas_kernels import threshold_search as kernels
from pallas_kernels.sampler_common import fits_int32_offsets, scale_rows


def slow_thresholds(x, divisor, desc, floor, k, p, total, floored, needed, fast, f: SamplerFeatures) -> jax.Array:
    """f32[R]: the thresholds of the `needed` rows, `fast` at the others. x [R, V] processed
    logits, scaled = x / divisor; desc [R, C] the rows' top C scaled values (descending);
    floor: min_p's threshold; k, p: top_k (0: off) and top_p (1: off); total: top_p's row
    mass from the block sums, wrong for the `floored` rows (top_p and min_p, no top_k)."""
    mode = f.kernels.slow_path
    if mode == "reference" or not fits_int32_offsets(x):
        row_mass, search = _reference_pieces(f)
    else:
        interpret = mode == "interpret"
        row_mass = functools.partial(kernels.row_mass, interpret=interpret)
        search = functools.partial(kernels.threshold_search, interpret=interpret)
    row_max = desc[:, 0]
    mass, settles = total, jnp.zeros_like(needed)
    if f.top_p and f.min_p:
        mass = jnp.where(floored, row_mass(x, divisor, row_max, floor, floored & needed), total)
        settles = floored & topk_topp.top_holds_top_p(desc, floor, p, mass)
    thresh = topk_topp.threshold_from_sorted(desc, floor, k, p, x.shape[-1], mass)
    searched = search(x, divisor, row_max, floor, k, p, needed & ~settles)
    return jnp.where(needed, jnp.where(settles, thresh, searched), fast)


def _reference_pieces(f: SamplerFeatures):
    """The jnp counterparts of the two kernels, same signatures, over every row."""
    def search(x, divisor, row_max, floor, k, p, rows):
        scaled = scale_rows(x, divisor)
        if f.top_k:
            floor = jnp.maximum(floor, topk_topp.top_k_threshold_search(scaled, k, f.search_arity))
        if not f.top_p:
            return floor
        return topk_topp.top_p_threshold_search(scaled, row_max, floor, p, f.search_arity)

    return kernels.row_mass_reference, search
