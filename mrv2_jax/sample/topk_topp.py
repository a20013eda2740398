"""min_p / top_k / top_p as per-row thresholds, found without sorting the vocabulary.

Every truncation here keeps the tokens whose (temperature-scaled) logit is >= a per-row
threshold, so the three combine by taking the largest threshold, and the masking itself is
fused into the final sampling pass. Semantics (as vLLM, ties kept together):

* min_p: keep logit >= max + log(min_p)          (prob >= min_p * max prob)
* top_k: keep logit >= the k-th largest logit    (every token tied with the k-th is kept)
* top_p: on the distribution left by min_p and top_k, keep a token iff the probability mass
  of the tokens strictly more likely than it is < p (the smallest top set reaching mass p,
  plus its ties). vLLM's sort-based version breaks ties at the boundary by sort order instead.
  top_p = 1 is "off" (nothing is removed, even tokens whose mass rounds to 0).

Threshold search ("threshold" method). The k-th largest value is the largest t with
count(x >= t) >= k; count is non-increasing in t, so a k-ary search over the 2**32 float bit
patterns (mapped to order-preserving uint32 keys) finds it exactly: each pass evaluates the
count at `arity - 1` evenly spaced candidates for every row at once (one variadic reduction that
reads the row once) and keeps the sub-interval holding the answer: ceil(32 / log2(arity))
passes (16 with the default arity 4), a fixed number, no data-dependent loop, no sort. top_p is
the same search on the unnormalised probabilities e = exp(x - max) (non-negative floats: their
bit patterns are already ordered) for the largest t with mass(e >= t) >= p * total, then mapped
back to a logit. Floating-point sums with one reduction shape are monotone in the set summed,
so the search invariant holds exactly in f32.

On GPUs the sampler's slow path runs the same searches as Pallas kernels
(pallas_kernels/threshold_search.py); these jnp ones are their reference and run elsewhere.
Costs of each: docs/sampler.md and docs/benchmarks.md.

The "sort" method (one full sort per row) computes the same thresholds; it is the reference
and the baseline for the GPU speed comparison.
"""

import math

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def min_p_threshold(row_max: jax.Array, min_p: jax.Array) -> jax.Array:
    return jnp.where(min_p > 0, row_max + jnp.log(jnp.maximum(min_p, 1e-30)), NEG_INF)


def top_k_enabled(k: jax.Array, vocab_size: int) -> jax.Array:
    return (k > 0) & (k < vocab_size)


def top_p_enabled(p: jax.Array) -> jax.Array:
    return p < 1


# ------------------------------------------------------------------------------------------
# k-ary search
# ------------------------------------------------------------------------------------------

def _ordered_key(x: jax.Array) -> jax.Array:
    """f32 -> u32 with the same order (negatives: flip all bits; others: set the sign bit)."""
    x = jnp.where(x == 0, 0.0, x)  # -0.0 and +0.0 compare equal, so give them one key
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _key_to_float(key: jax.Array) -> jax.Array:
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def num_search_passes(arity: int) -> int:
    return math.ceil(32 / math.log2(arity))


def _search_largest(value_at, target, lo, hi, arity: int):
    """Largest u32 t in [lo, hi] with value_at(t) >= target, per row, where value_at is
    non-increasing in t and value_at(lo) >= target. value_at: u32[R, C] -> [R, C]."""
    j = jnp.arange(1, arity, dtype=jnp.uint32)

    def one_pass(_, bounds):
        lo, hi = bounds
        span = hi - lo
        step = span // arity + 1
        # step * j <= span + arity; clamp so that the candidates never pass hi (or wrap).
        cands = lo[:, None] + jnp.minimum(step[:, None] * j, span[:, None])
        ok = value_at(cands) >= target[:, None]  # True ... True False ... False per row
        n_ok = jnp.sum(ok, axis=1)
        take = lambda i: jnp.take_along_axis(cands, jnp.clip(i, 0, arity - 2)[:, None], 1)[:, 0]  # noqa: E731
        return (jnp.where(n_ok > 0, take(n_ok - 1), lo),
                jnp.where(n_ok < arity - 1, take(n_ok) - 1, hi))

    return jax.lax.fori_loop(0, num_search_passes(arity), one_pass, (lo, hi))[0]


def _sum_per_candidate(term, cands: jax.Array, dtype) -> jax.Array:
    """[R, C]: for each candidate column j, the row sum over V of term(cands[:, j:j+1]).

    Written as ONE variadic reduction with C accumulators, so the [R, V] input is read once per
    pass for all candidates. The obvious broadcast form, sum(term over [R, C, V], axis=-1), made
    XLA read the input once per candidate (pass time grew with C).
    One reduction also sums every candidate's terms in the same order, which keeps the sums
    monotone in the candidate exactly."""
    c = cands.shape[1]
    terms = tuple(term(cands[:, j : j + 1]) for j in range(c))
    zeros = tuple(jnp.zeros((), dtype) for _ in range(c))
    sums = jax.lax.reduce(terms, zeros, lambda a, b: tuple(x + y for x, y in zip(a, b)), (1,))
    return jnp.stack(sums, axis=1)


def top_k_threshold_search(x: jax.Array, k: jax.Array, arity: int = 4) -> jax.Array:
    """f32[R] threshold keeping the top k of each row of x (-inf where top-k is off)."""
    r, v = x.shape
    keys = _ordered_key(x)

    def count_at(cands):  # [R, C] -> number of elements with key >= candidate
        return _sum_per_candidate(lambda c: (keys >= c).astype(jnp.int32), cands, jnp.int32)

    lo = jnp.zeros((r,), jnp.uint32)
    hi = jnp.full((r,), 0xFFFFFFFF, jnp.uint32)
    kth = _key_to_float(_search_largest(count_at, jnp.clip(k, 1, v), lo, hi, arity))
    return jnp.where(top_k_enabled(k, v), kth, NEG_INF)


def top_p_threshold_search(x: jax.Array, row_max: jax.Array, floor: jax.Array, p: jax.Array,
                           arity: int = 4) -> jax.Array:
    """f32[R] threshold for top_p over the tokens with x >= floor; `floor` where top-p is off."""
    r = x.shape[0]
    # Materialised once, so every pass reads one array and computes no exp.
    e = jnp.where(x >= floor[:, None], jnp.exp(x - row_max[:, None]), 0.0)
    ekeys = jax.lax.bitcast_convert_type(e, jnp.uint32)  # e >= 0: bit order == value order

    def mass_at(cands):
        return _sum_per_candidate(lambda c: jnp.where(ekeys >= c, e, 0.0), cands, jnp.float32)

    total = jnp.sum(e, axis=-1)
    lo = jnp.zeros((r,), jnp.uint32)
    hi = jnp.full((r,), 0x3F800000, jnp.uint32)  # 1.0 = exp(0), the largest e
    cut = _search_largest(mass_at, p * total, lo, hi, arity)
    # Back to logit space: the smallest logit among the kept tokens (e is monotone in x).
    tau = jnp.min(jnp.where(ekeys >= cut[:, None], x, jnp.inf), axis=-1)
    return jnp.where(top_p_enabled(p), jnp.maximum(tau, floor), floor)


def top_k_top_p_threshold_search(x: jax.Array, floor: jax.Array, k: jax.Array, p: jax.Array,
                                 arity: int = 4) -> jax.Array:
    """Both searches over every row: top_k's threshold raised to `floor`, then top_p's over the
    tokens at or above it (what the slow path's kernel computes for the rows it searches)."""
    below = jnp.maximum(floor, top_k_threshold_search(x, k, arity))
    return top_p_threshold_search(x, jnp.max(x, axis=-1), below, p, arity)


# ------------------------------------------------------------------------------------------
# Sort-based reference
# ------------------------------------------------------------------------------------------

def top_k_top_p_threshold_sort(x: jax.Array, floor: jax.Array, k: jax.Array, p: jax.Array) -> jax.Array:
    """The combined top_k + top_p threshold (with `floor` from min_p) from one sort per row."""
    return threshold_from_sorted(jnp.flip(jnp.sort(x, axis=-1), axis=-1), floor, k, p, x.shape[-1])


def threshold_from_sorted(desc: jax.Array, floor: jax.Array, k: jax.Array, p: jax.Array,
                          vocab_size: int, total: jax.Array | None = None) -> jax.Array:
    """The top_k + top_p threshold from the row's largest values sorted descending, desc [R, C]:
    the whole row (C = V), or its top C when every token the truncation keeps is among them,
    or when the top C already hold mass p of the row's `total` (exp(x - max) over x >= floor)."""
    c = desc.shape[-1]
    kth = jnp.take_along_axis(desc, jnp.clip(k - 1, 0, c - 1)[:, None], 1)[:, 0]
    floor = jnp.maximum(floor, jnp.where(top_k_enabled(k, vocab_size), kth, NEG_INF))
    e = jnp.where(desc >= floor[:, None], jnp.exp(desc - desc[:, :1]), 0.0)
    cum = jnp.cumsum(e, axis=-1)
    total = cum[:, -1] if total is None else jnp.where(top_k_enabled(k, vocab_size), cum[:, -1], total)
    first = jnp.sum(cum < (p * total)[:, None], axis=-1)  # first index reaching mass p
    tau = jnp.take_along_axis(desc, jnp.minimum(first, c - 1)[:, None], 1)[:, 0]
    return jnp.where(top_p_enabled(p), jnp.maximum(tau, floor), floor)


def top_holds_top_p(desc: jax.Array, floor: jax.Array, p: jax.Array, total: jax.Array) -> jax.Array:
    """bool[R]: top_p is on and the C values in desc (the row's top C, descending) reach mass
    p of the row's total on their own, so top_p's cut-off is among them."""
    e = jnp.where(desc >= floor[:, None], jnp.exp(desc - desc[:, :1]), 0.0)
    return top_p_enabled(p) & (jnp.sum(jnp.cumsum(e, axis=-1) < (p * total)[:, None], axis=-1) < desc.shape[-1])


# ------------------------------------------------------------------------------------------
# Fast path: top_k small enough that everything kept is among the row's top few
# ------------------------------------------------------------------------------------------

# Width of the candidate set: rows with top_k < this (Qwen's recommended 20, the common 40/50),
# and top_p-only rows whose top C tokens already hold mass p (peaked distributions: most
# steps of a real model), take the fast path: their top C values come from block maxima
# (block_top.py) and the cut-offs are found on C sorted values instead of searching the row.
TOP_CANDIDATES = 64


def top_covers_top_k(desc: jax.Array, k: jax.Array, vocab_size: int) -> jax.Array:
    """bool[R]: top_k is on and keeps only tokens among the C values in desc (the row's top C,
    sorted descending), i.e. no token tied with the k-th largest is left outside them."""
    c = desc.shape[-1]
    kth = jnp.take_along_axis(desc, jnp.clip(k - 1, 0, c - 1)[:, None], 1)[:, 0]
    whole_row = c == vocab_size
    return top_k_enabled(k, vocab_size) & (k <= c) & (whole_row | (desc[:, -1] < kth))
