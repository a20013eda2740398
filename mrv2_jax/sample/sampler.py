"""Token sampling on the device, inside the jitted step.

Pipeline, per row (vLLM's order):

    logits (f32) -> logit_bias + min_tokens (sparse edits) -> penalties        = processed
    greedy rows (temperature 0):  argmax(processed)
    sampled rows:  processed / T -> min_p -> top_k -> top_p -> argmax(masked + Gumbel noise)

Greedy rows ignore temperature, min_p, top_k and top_p (the maximum survives every
truncation anyway). The truncations are per-row thresholds (see topk_topp.py), so the final
pass is one fused read of the logits: scale, mask below the threshold, add noise, argmax.
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
from mrv2_jax.sample.gumbel import gumbel_noise
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
        scaled = x / jnp.where(is_sampled, t.temperature, 1.0)[:, None]
        keep_from = truncation_threshold(scaled, t, f)
        noisy = jnp.where(scaled >= keep_from[:, None], scaled, NEG_INF)
        noisy = noisy + gumbel_noise(t.seeds, positions, x.shape[-1])
        # Greedy rows of a mixed batch take the argmax of their processed logits.
        return jnp.argmax(jnp.where(is_sampled[:, None], noisy, x), axis=-1).astype(jnp.int32)

    return _maybe(f.runtime_skip, jnp.any(t.temperature > 0), sampled, greedy)


def truncation_threshold(scaled: jax.Array, t: SamplingTensors, f: SamplerFeatures) -> jax.Array:
    """f32[R]: each row keeps the tokens with scaled logit >= this (-inf: keeps everything).

    With runtime skips, one conditional skips all truncations when no row uses any (the usual
    case: one predicate, not three), and inside it each truncation has its own. Conditionals
    return only [R] thresholds."""
    r, v = scaled.shape
    none = lambda: jnp.full((r,), NEG_INF, jnp.float32)  # noqa: E731
    used = {"min_p": jnp.any(t.min_p > 0), "top_k": jnp.any(topk_topp.top_k_enabled(t.top_k, v)),
            "top_p": jnp.any(topk_topp.top_p_enabled(t.top_p))}
    enabled = [name for name in used if getattr(f, name)]
    if not enabled:
        return none()
    if not f.runtime_skip:
        return _thresholds(scaled, t, f, used)
    any_used = jnp.any(jnp.stack([used[name] for name in enabled]))
    return jax.lax.cond(any_used, lambda: _thresholds(scaled, t, f, used), none)


def _thresholds(scaled, t: SamplingTensors, f: SamplerFeatures, used) -> jax.Array:
    r, v = scaled.shape
    none = lambda: jnp.full((r,), NEG_INF, jnp.float32)  # noqa: E731
    # The fast path's top values come from one pass over the row; min_p's row maximum is the
    # first of them, so min_p then costs no pass of its own.
    block_path = (f.top_k or f.top_p) and f.top_k_top_p != "sort"
    desc = top_n_by_blocks(scaled, min(topk_topp.TOP_CANDIDATES, v))[0] if block_path else None
    thresh = none()
    if f.min_p:
        row_max = (lambda: desc[:, 0]) if block_path else (lambda: jnp.max(scaled, axis=-1))
        thresh = _maybe(f.runtime_skip, used["min_p"], lambda: topk_topp.min_p_threshold(row_max(), t.min_p), none)
    if not (f.top_k or f.top_p):
        return thresh
    floor = thresh
    k = t.top_k if f.top_k else jnp.zeros_like(t.top_k)
    p = t.top_p if f.top_p else jnp.ones_like(t.top_p)
    if f.top_k_top_p == "sort":
        return _maybe(f.runtime_skip, (used["top_k"] & f.top_k) | (used["top_p"] & f.top_p),
                      lambda: topk_topp.top_k_top_p_threshold_sort(scaled, floor, k, p), lambda: floor)
    # Rows whose truncation keeps only tokens among the row's top few finish on those few
    # values (topk_topp.py "fast path"); the others, if any, run the whole-row search.
    covered = topk_topp.top_covers_top_k(desc, k, v)
    total = None
    if f.top_p:
        total = topk_topp.row_mass(scaled, desc[:, 0], floor)
        covered |= ~topk_topp.top_k_enabled(k, v) & topk_topp.top_holds_top_p(desc, floor, p, total)
    fast = topk_topp.threshold_from_sorted(desc, floor, k, p, v, total)
    needs_search = ~covered & (topk_topp.top_k_enabled(k, v) | topk_topp.top_p_enabled(p))
    slow = _maybe(f.runtime_skip, jnp.any(needs_search),
                  lambda: _search_thresholds(scaled, t, f, used, floor), lambda: fast)
    return jnp.where(covered, fast, slow)


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
