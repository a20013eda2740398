"""The threshold slow path: min_p / top_k / top_p cut-offs of the sampled rows that their top
candidates do not settle (sampler.threshold_and_top), found by reading the whole row.

Two whole-row pieces: top_p's mass above a min_p floor (rows with top_p and min_p but no top_k;
the block sums cannot tell it), then, for the rows that mass does not settle either, the k-ary
threshold search (topk_topp.py). Few rows of a real batch need them (top_k <= 64, or top_p on a
peaked row, finish on the top candidates), so the others must cost next to nothing. Two ways to
skip them (`MRV2_SAMPLER_SLOW_PATH`, features.whole_row_pass_mode):

* "cond" (the default off GPUs): one `lax.cond` around both pieces, skipped when no row needs
  them, with one conditional inside it for each search (top_k's, top_p's).
* "kernel" (the default on GPUs): two Pallas kernels (pallas_kernels/threshold_search.py), run
  unconditionally, one program per row; programs of rows that need nothing exit at once. On an
  H200 the conditional cost a step ~0.3 ms whether taken or not (docs/benchmarks.md). The
  kernels' masses are f32 sums in another order than XLA's: a top_p cut-off that falls within
  rounding of the boundary may differ by one token from the "cond" path's, as it may from vLLM's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mrv2_jax.sample import topk_topp
from mrv2_jax.sample.features import SamplerFeatures, run_if_used, skipped_conditionals, whole_row_pass_mode
from mrv2_jax.sample.logit_stats import fits_int32_offsets, scale_rows

NEG_INF = -jnp.inf


def slow_path_mode() -> str:
    """MRV2_SAMPLER_SLOW_PATH: "auto", "cond", "kernel" or "interpret" (features.py)."""
    return whole_row_pass_mode("MRV2_SAMPLER_SLOW_PATH")


def slow_thresholds(x, divisor, desc, floor, k, p, total, floored, needed, fast, f: SamplerFeatures) -> jax.Array:
    """f32[R]: the thresholds of the `needed` rows, `fast` at the others. x [R, V] processed
    logits, scaled = x / divisor; desc [R, C] the rows' top C scaled values (descending);
    floor: min_p's threshold; k, p: top_k (0: off) and top_p (1: off); total: top_p's row
    mass from the block sums, wrong for the `floored` rows (top_p and min_p, no top_k)."""
    mode = slow_path_mode()

    def slow(kernels=None):
        return jnp.where(needed, _slow_path(x, divisor, desc, floor, k, p, total, floored, needed, f, kernels), fast)

    if mode == "cond" or "slow" in skipped_conditionals():  # (skipping: benchmarks only, features.py)
        return run_if_used(f.runtime_skip, jnp.any(needed), slow, lambda: fast, "slow")
    if fits_int32_offsets(x) and (mode == "interpret" or jax.default_backend() == "gpu"):
        from pallas_kernels import threshold_search

        return slow(_Kernels(threshold_search, mode == "interpret"))
    return slow()  # "kernel" elsewhere: the jnp searches, no conditional


class _Kernels:
    """pallas_kernels/threshold_search.py's kernels, interpreted or not."""

    def __init__(self, module, interpret: bool):
        self.row_mass = functools.partial(module.row_mass, interpret=interpret)
        self.threshold_search = functools.partial(module.threshold_search, interpret=interpret)


def _slow_path(x, divisor, desc, floor, k, p, total, floored, needed, f, kernels) -> jax.Array:
    """The floored rows' mass, then the search for the rows it does not settle either; by the
    kernels, or (kernels None) by jnp over every row."""
    row_max = desc[:, 0]
    mass, settles = total, jnp.zeros_like(needed)
    if f.top_p and f.min_p:
        rows = floored & needed
        row_mass = (kernels.row_mass(x, divisor, row_max, floor, rows) if kernels
                    else topk_topp.row_mass(scale_rows(x, divisor), row_max, floor))
        mass = jnp.where(floored, row_mass, total)
        settles = floored & topk_topp.top_holds_top_p(desc, floor, p, mass)
    thresh = topk_topp.threshold_from_sorted(desc, floor, k, p, x.shape[-1], mass)
    rows = needed & ~settles
    searched = (kernels.threshold_search(x, divisor, row_max, floor, k, p, rows) if kernels
                else _searches(scale_rows(x, divisor), row_max, floor, k, p, rows, f))
    return jnp.where(settles, thresh, searched)


def _searches(scaled, row_max, floor, k, p, rows, f) -> jax.Array:
    """top_k then top_p by k-ary search over every row (topk_topp.py); with runtime skips in
    "cond" mode, each is skipped when no row in `rows` uses it. These two conditionals sit
    inside the slow path's own: on an H200 that depth cost ~15 us per step, where a third level,
    or one four-way switch in their place, left the GPU idle 0.1-0.2 ms (docs/sampler.md)."""
    skip = f.runtime_skip and slow_path_mode() == "cond"
    v = scaled.shape[-1]
    if f.top_k:
        kth = run_if_used(skip, jnp.any(rows & topk_topp.top_k_enabled(k, v)),
                          lambda: topk_topp.top_k_threshold_search(scaled, k, f.search_arity),
                          lambda: jnp.full(floor.shape, NEG_INF, jnp.float32), "search")
        floor = jnp.maximum(floor, kth)
    if not f.top_p:
        return floor
    below = floor
    return run_if_used(skip, jnp.any(rows & topk_topp.top_p_enabled(p)),
                       lambda: topk_topp.top_p_threshold_search(scaled, row_max, below, p, f.search_arity),
                       lambda: below, "search")
