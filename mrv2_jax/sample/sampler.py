"""Token sampling on the device, inside the jitted step.

Pipeline, per row (vLLM's order):

    logits (f32) -> logit_bias + min_tokens (sparse edits) -> penalties        = processed
    greedy rows (temperature 0):  argmax(processed)
    sampled rows:  processed / T -> min_p -> top_k -> top_p -> argmax(masked + Gumbel noise)

Greedy rows ignore temperature, min_p, top_k and top_p (the maximum survives every
truncation anyway). The truncations are per-row thresholds (see topk_topp.py). A row whose
kept tokens all lie among its top 64 values (top_k <= 64, or top_p on a peaked row), which the
threshold search found already, draws among those 64 alone; any other row takes one fused read
of the logits: scale, mask below the threshold, add noise, argmax. Both give the same token.
Gumbel noise is keyed by (seed, position) only (gumbel.py), so a seeded request gets the same
tokens in any batch. Logprobs come from the raw logits (logprobs.py).

`features` (static) says what is compiled in and whether unused features are skipped at run
time; features.py explains the trade-off and why no [R, V] array leaves a conditional.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mrv2_jax.sample import topk_topp
from mrv2_jax.sample.block_top import top_n_by_blocks
from mrv2_jax.sample.features import SamplerFeatures
from mrv2_jax.sample.gumbel import gumbel_noise, gumbel_noise_at
from mrv2_jax.sample.logit_bias import apply_sparse_edits, edit_after_penalties, uses_sparse_edits
from mrv2_jax.sample.logprobs import compute_logprobs, empty_logprobs
from mrv2_jax.sample.penalties import PenaltyData, apply_penalties, uses_penalties
from mrv2_jax.sample.tensors import SamplingTensors

__all__ = ["SamplerOutput", "sample", "sample_tokens", "gumbel_noise"]

NEG_INF = -jnp.inf


class SamplerOutput(NamedTuple):
    tokens: jax.Array  # i32[R]
    logprobs: jax.Array | None = None  # f32[R, 1 + n]: sampled token, then the top n (raw logits)
    logprob_token_ids: jax.Array | None = None  # i32[R, 1 + n]
    sampled_rank: jax.Array | None = None  # i32[R]: 1 + tokens with a larger raw logit
    # Prompt logprobs (features.prompt_logprobs, model_step.prompt_logprobs): per scheduled
    # TOKEN t, the raw logprob of the prompt token that follows it, then the top n.
    prompt_logprobs: jax.Array | None = None  # f32[T, 1 + n]
    prompt_token_ids: jax.Array | None = None  # i32[T, 1 + n]
    prompt_rank: jax.Array | None = None  # i32[T]


def sample(logits: jax.Array, t: SamplingTensors, positions: jax.Array, features: SamplerFeatures,
           penalties: PenaltyData | None = None) -> SamplerOutput:
    """logits [R, V] (any float dtype); positions i32[R]: position of the token being sampled."""
    f = features
    if f.penalties and penalties is None:
        raise ValueError("features.penalties needs PenaltyData")
    x = logits.astype(jnp.float32)
    adjusts = f.logit_bias or f.min_tokens or f.penalties
    with_adjust = lambda x: _pick_tokens(adjust_logits(x, t, f, penalties), t, positions, f)  # noqa: E731
    if adjusts and f.runtime_skip:
        # Both branches run the rest of the sampler and return tokens: a conditional returning
        # the adjusted [R, V] logits would copy them in the branch that adjusts nothing.
        used = uses_penalties(t) if f.penalties else jnp.zeros((), bool)
        used |= uses_sparse_edits(t, bias=f.logit_bias, min_tokens=f.min_tokens)
        tokens = jax.lax.cond(used, with_adjust, lambda x: _pick_tokens(x, t, positions, f), x)
    elif adjusts:
        tokens = with_adjust(x)
    else:
        tokens = _pick_tokens(x, t, positions, f)

    if f.num_logprobs is None:
        return SamplerOutput(tokens)
    n = f.num_logprobs
    lp = _maybe(f.runtime_skip, jnp.any(t.num_logprobs >= 0),
                lambda: compute_logprobs(x, tokens, n), lambda: empty_logprobs(x.shape[0], n))
    return SamplerOutput(tokens, lp.logprobs, lp.token_ids, lp.sampled_rank)


def adjust_logits(x: jax.Array, t: SamplingTensors, f: SamplerFeatures,
                  penalties: PenaltyData | None) -> jax.Array:
    """logit_bias, min_tokens and penalties, with vLLM's result (bias -> mask -> penalties)."""
    if not f.penalties:
        return apply_sparse_edits(x, t, bias=f.logit_bias, min_tokens=f.min_tokens)
    # The penalty pass writes a fresh array; the sparse edits then go into it in place.
    return edit_after_penalties(apply_penalties(x, t, penalties), x, t, penalties,
                                bias=f.logit_bias, min_tokens=f.min_tokens)


def _maybe(runtime_skip: bool, used: jax.Array, compute, skip):
    """compute() if any row uses the feature; with runtime skips off, always compute()."""
    if not runtime_skip:
        return compute()
    return jax.lax.cond(used, compute, skip)


def _pick_tokens(x: jax.Array, t: SamplingTensors, positions: jax.Array, f: SamplerFeatures) -> jax.Array:
    """x: processed logits (after bias / penalties). -> i32[R]."""
    greedy = lambda: jnp.argmax(x, axis=-1).astype(jnp.int32)  # noqa: E731
    if not f.sampling:
        return greedy()

    def sampled():
        is_sampled = t.temperature > 0
        divisor = jnp.where(is_sampled, t.temperature, 1.0)
        keep_from, top = threshold_and_top(x, divisor, t, f)

        def whole_row():
            # x / divisor is recomputed inside each conditional branch that reads it: a value
            # handed to a conditional is written out first (one more [R, V] pass).
            scaled = x / divisor[:, None]
            noisy = jnp.where(scaled >= keep_from[:, None], scaled, NEG_INF)
            noisy = noisy + gumbel_noise(t.seeds, positions, x.shape[-1])
            # Greedy rows of a mixed batch take the argmax of their processed logits.
            return jnp.argmax(jnp.where(is_sampled[:, None], noisy, x), axis=-1).astype(jnp.int32)

        if top is None:
            return whole_row()
        # A row whose kept tokens all lie among its top C (the threshold is above the C-th
        # largest value: top_k <= C, or a peaked top_p) samples from those C alone, with the
        # noise of their ids: the same token as the whole-row pass, without reading the row.
        on_top = is_sampled & (keep_from > top[0][:, -1])
        from_top = _sample_among(top, keep_from, t.seeds, positions)
        rest = _maybe(f.runtime_skip, jnp.any(~on_top), whole_row, lambda: from_top)
        return jnp.where(on_top, from_top, rest)

    return _maybe(f.runtime_skip, jnp.any(t.temperature > 0), sampled, greedy)


def _sample_among(top, keep_from: jax.Array, seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """argmax(value + noise) over the candidates (values [R, C], token ids [R, C]) at or above
    keep_from, ties to the lowest token id as jnp.argmax over the whole row -> i32[R]."""
    values, ids = top
    noisy = jnp.where(values >= keep_from[:, None], values + gumbel_noise_at(seeds, positions, ids), NEG_INF)
    best = jnp.max(noisy, axis=-1, keepdims=True)
    return jnp.min(jnp.where(noisy == best, ids, jnp.iinfo(jnp.int32).max), axis=-1).astype(jnp.int32)


def truncation_threshold(scaled: jax.Array, t: SamplingTensors, f: SamplerFeatures) -> jax.Array:
    """f32[R]: each row keeps the tokens with scaled logit >= this (-inf: keeps everything)."""
    return threshold_and_top(scaled, jnp.ones(scaled.shape[:1], scaled.dtype), t, f)[0]


def threshold_and_top(x: jax.Array, divisor: jax.Array, t: SamplingTensors, f: SamplerFeatures):
    """For scaled = x / divisor[:, None] -> (f32[R]: each row keeps the tokens with scaled logit
    >= this, -inf keeps everything; the row's top C scaled values and their ids [R, C] when the
    block path found them, else None).

    With runtime skips, one conditional skips all truncations when no row uses any (the usual
    case: one predicate, not three), and inside it each truncation has its own. Conditionals
    return only [R] thresholds and [R, C] candidates."""
    r, v = x.shape
    none = lambda: jnp.full((r,), NEG_INF, jnp.float32)  # noqa: E731
    used = {"min_p": jnp.any(t.min_p > 0), "top_k": jnp.any(topk_topp.top_k_enabled(t.top_k, v)),
            "top_p": jnp.any(topk_topp.top_p_enabled(t.top_p))}
    enabled = [name for name in used if getattr(f, name)]
    if not enabled:
        return none(), None
    block_path = (f.top_k or f.top_p) and f.top_k_top_p != "sort"
    c = min(topk_topp.TOP_CANDIDATES, v)
    nothing = lambda: (none(), (jnp.full((r, c), NEG_INF, jnp.float32), jnp.zeros((r, c), jnp.int32)))  # noqa: E731
    if not f.runtime_skip:
        thresh, top = _thresholds(x, divisor, t, f, used)
    else:
        any_used = jnp.any(jnp.stack([used[name] for name in enabled]))
        if block_path:
            thresh, top = jax.lax.cond(any_used, lambda: _thresholds(x, divisor, t, f, used), nothing)
        else:
            thresh, top = jax.lax.cond(any_used, lambda: _thresholds(x, divisor, t, f, used)[0], none), None
    return thresh, top


def _thresholds(x, divisor, t: SamplingTensors, f: SamplerFeatures, used):
    """-> (thresholds f32[R], (top values, ids) [R, C] or None) for the truncations in use."""
    r, v = x.shape
    scaled = x / divisor[:, None]  # fused into the passes that read it, never written out
    none = lambda: jnp.full((r,), NEG_INF, jnp.float32)  # noqa: E731
    # The fast path's top values come from one pass over the row; min_p's row maximum is the
    # first of them, so min_p then costs no pass of its own.
    block_path = (f.top_k or f.top_p) and f.top_k_top_p != "sort"
    top = tuple(top_n_by_blocks(scaled, min(topk_topp.TOP_CANDIDATES, v))) if block_path else None
    desc = top[0] if block_path else None
    thresh = none()
    if f.min_p:
        row_max = (lambda: desc[:, 0]) if block_path else (lambda: jnp.max(scaled, axis=-1))
        thresh = _maybe(f.runtime_skip, used["min_p"], lambda: topk_topp.min_p_threshold(row_max(), t.min_p), none)
    if not (f.top_k or f.top_p):
        return thresh, top
    floor = thresh
    k = t.top_k if f.top_k else jnp.zeros_like(t.top_k)
    p = t.top_p if f.top_p else jnp.ones_like(t.top_p)
    if f.top_k_top_p == "sort":
        return _maybe(f.runtime_skip, (used["top_k"] & f.top_k) | (used["top_p"] & f.top_p),
                      lambda: topk_topp.top_k_top_p_threshold_sort(scaled, floor, k, p), lambda: floor), None
    # Rows whose truncation keeps only tokens among the row's top few finish on those few
    # values (topk_topp.py "fast path"); the others, if any, run the whole-row search.
    covered = topk_topp.top_covers_top_k(desc, k, v)
    total = None
    if f.top_p:
        # The row's mass is needed only where top_p runs without top_k (with top_k the mass
        # is that of the kept top values): a whole-row pass skipped when no row needs it.
        needs_mass = topk_topp.top_p_enabled(p) & ~topk_topp.top_k_enabled(k, v)
        total = _maybe(f.runtime_skip, jnp.any(needs_mass),
                       lambda: topk_topp.row_mass(x / divisor[:, None], desc[:, 0], floor),
                       lambda: jnp.zeros((r,), jnp.float32))
        covered |= ~topk_topp.top_k_enabled(k, v) & topk_topp.top_holds_top_p(desc, floor, p, total)
    fast = topk_topp.threshold_from_sorted(desc, floor, k, p, v, total)
    needs_search = ~covered & (topk_topp.top_k_enabled(k, v) | topk_topp.top_p_enabled(p))
    slow = _maybe(f.runtime_skip, jnp.any(needs_search),
                  lambda: _search_thresholds(x / divisor[:, None], t, f, used, floor), lambda: fast)
    return jnp.where(covered, fast, slow), top


def _search_thresholds(scaled, t: SamplingTensors, f: SamplerFeatures, used, floor) -> jax.Array:
    """top_k then top_p by k-ary search over the whole row (topk_topp.py)."""
    none = lambda: jnp.full((scaled.shape[0],), NEG_INF, jnp.float32)  # noqa: E731
    thresh = floor
    if f.top_k:
        kth = _maybe(f.runtime_skip, used["top_k"],
                     lambda: topk_topp.top_k_threshold_search(scaled, t.top_k, f.search_arity), none)
        thresh = jnp.maximum(thresh, kth)
    if f.top_p:
        floor = thresh
        thresh = _maybe(f.runtime_skip, used["top_p"],
                        lambda: topk_topp.top_p_threshold_search(scaled, jnp.max(scaled, axis=-1), floor,
                                                                 t.top_p, f.search_arity),
                        lambda: floor)
    return thresh


def sample_tokens(logits, temperature, seeds, positions) -> jax.Array:
    """Temperature-only sampling (the original entry point): logits f32[R, V]; temperature
    f32[R] (0 = greedy); seeds i32[R]; positions i32[R] -> i32[R]."""
    r = logits.shape[0]
    t = SamplingTensors.neutral(r, max_bias=0, max_stop=0, xp=jnp)
    t = dataclasses.replace(t, temperature=temperature.astype(jnp.float32), seeds=seeds.astype(jnp.int32))
    return sample(logits, t, positions, SamplerFeatures()).tokens
