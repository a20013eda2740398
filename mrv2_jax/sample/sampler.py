"""Token sampling on the device, inside the jitted step.

Pipeline, per row (vLLM's order):

    logits (any float dtype, read as f32) -> logit_bias + min_tokens (sparse edits) -> penalties = processed
    greedy rows (temperature 0):  argmax(processed)
    sampled rows:  processed / T -> min_p -> top_k -> top_p -> argmax(masked + Gumbel noise)

Greedy rows ignore temperature, min_p, top_k and top_p (the maximum survives every
truncation anyway). The truncations are per-row thresholds (see topk_topp.py), found on each
row's top 64 values (block maxima, block_top.py) or, for rows those do not settle, by a search
over the whole row. A row whose kept tokens all lie among its top 64 (top_k <= 64, or top_p on a
peaked row) draws among those alone, and a greedy row takes the first; any other row takes one
fused read of the logits: scale, mask below the threshold, add noise, argmax. Both give the
same token.
Gumbel noise is keyed by (seed, position) only (gumbel.py), so a seeded request gets the same
tokens in any batch. Logprobs come from the raw logits (logprobs.py). One pass over the logits
(logit_stats.py: a Pallas kernel on GPUs) writes the penalised logits and the per-block maxima
and exp-sums that the top candidates, top_p's mass and the logprobs start from.

`features` (static) says what is compiled in, whether prompt logprobs are skipped at run time and
which whole-row pieces run as Pallas kernels (features.kernels); features.py explains why the
decode step holds no conditional.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mrv2_jax.sample import topk_topp
from mrv2_jax.sample.block_top import top_n_by_blocks
from mrv2_jax.sample.features import SamplerFeatures, run_if_used
from mrv2_jax.sample.gumbel import gumbel_noise, gumbel_noise_at
from mrv2_jax.sample.logit_bias import apply_sparse_edits, edit_after_penalties, edited_ids
from mrv2_jax.sample.logit_stats import block_max_and_sumexp, logit_stats, mass_from_blocks, refresh_blocks
from mrv2_jax.sample.logprobs import compute_logprobs
from mrv2_jax.sample.noise_pass import noise_pass_reference, noise_pass_rows
from mrv2_jax.sample.penalties import PenaltyData, apply_penalties
from mrv2_jax.sample.slow_path import slow_thresholds
from mrv2_jax.sample.tensors import SamplingTensors
from pallas_kernels.sampler_common import reciprocal, scale_rows

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
    is_sampled = t.temperature > 0 if f.sampling else jnp.zeros(t.temperature.shape, bool)
    divisor = jnp.where(is_sampled, t.temperature, 1.0)
    # One pass over the logits (logit_stats.py) gives the penalised logits, the block maxima
    # that the top candidates and the logprobs start from, the logprobs' logsumexp and top_p's
    # mass. Gathers read `logits` in their own dtype: a gather from `x` made XLA write x out.
    stats = blocks = None
    if f.penalties or f.num_logprobs is not None or _uses_candidates(f):
        stats = logit_stats(logits, t, penalties if f.penalties else None, divisor, f.kernels.logit_stats)
        blocks = (stats.block_max, stats.block_sumexp)
    processed = x if stats is None else stats.processed
    # The edits run whenever they are compiled in, used or not: a conditional around them would
    # have to return the [R, V] logits, and copies them in the branch that edits nothing
    # (features.py); rows that use none carry neutral values.
    if f.logit_bias or f.min_tokens:
        processed = apply_edits(processed, logits, t, f, penalties)
        if blocks is not None:
            blocks = refresh_blocks(*blocks, processed, edited_ids(t, f, x.shape[-1]), divisor)
    tokens = _pick_tokens(processed, blocks, t, positions, f)
    if f.num_logprobs is None:
        return SamplerOutput(tokens)
    # Computed whenever compiled in (features.py).
    lp = compute_logprobs(logits, tokens, f.num_logprobs, (stats.raw_block_max, stats.raw_block_sumexp),
                          f.kernels.logit_stats)
    return SamplerOutput(tokens, lp.logprobs, lp.token_ids, lp.sampled_rank)


def _uses_candidates(f: SamplerFeatures) -> bool:
    """Whether the variant finds each row's top candidates (threshold_and_top)."""
    return f.sampling and (f.min_p or f.top_k or f.top_p) and f.top_k_top_p != "sort"


def apply_edits(processed: jax.Array, raw: jax.Array, t: SamplingTensors, f: SamplerFeatures,
                penalties: PenaltyData | None) -> jax.Array:
    """logit_bias and min_tokens on the penalised logits (raw: the logits, any dtype), with
    vLLM's result (bias -> mask -> penalties): logit_bias.py explains why they may come after
    the penalty pass."""
    if not f.penalties:
        return apply_sparse_edits(processed, t, bias=f.logit_bias, min_tokens=f.min_tokens)
    return edit_after_penalties(processed, raw, t, penalties, bias=f.logit_bias, min_tokens=f.min_tokens)


def adjust_logits(x: jax.Array, t: SamplingTensors, f: SamplerFeatures,
                  penalties: PenaltyData | None) -> jax.Array:
    """logit_bias, min_tokens and penalties on f32 logits x (the sampler's `processed`)."""
    processed = apply_penalties(x, t, penalties) if f.penalties else x
    return apply_edits(processed, x, t, f, penalties) if (f.logit_bias or f.min_tokens) else processed


def _pick_tokens(x: jax.Array, blocks, t: SamplingTensors, positions: jax.Array, f: SamplerFeatures) -> jax.Array:
    """x: processed logits (after bias / penalties); blocks: their LogitStats (block_max,
    block_sumexp) or None. -> i32[R]."""
    if not f.sampling:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    is_sampled = t.temperature > 0
    divisor = jnp.where(is_sampled, t.temperature, 1.0)

    def whole_row(keep_from):
        # The scaled logits are recomputed inside the conditional branch that reads them: a
        # value handed to a conditional is written out first (one more [R, V] pass). Greedy rows
        # of a mixed batch take the argmax of their processed logits.
        return noise_pass_reference(x, divisor, keep_from, t.seeds, positions, is_sampled)

    if not (f.min_p or f.top_k or f.top_p):
        # Temperature only: a batch of greedy rows skips the noise (one conditional; the plain
        # variant has runtime skips off and none).
        no_cut = jnp.full(is_sampled.shape, NEG_INF, jnp.float32)
        return run_if_used(f.runtime_skip, jnp.any(is_sampled), lambda: whole_row(no_cut),
                           lambda: jnp.argmax(x, axis=-1).astype(jnp.int32))
    keep_from, top = threshold_and_top(x, divisor, t, f, blocks)
    if top is None:  # the sort reference
        return whole_row(keep_from)
    # A row whose kept tokens all lie among its top C (the threshold is above the C-th largest
    # value: top_k <= C, or a peaked top_p) samples from those C alone, with the noise of their
    # ids: the same token as the whole-row pass, without reading the row. A greedy row's pick is
    # the first of them (ties to the lowest id, as argmax) unless its row is all -inf.
    values, ids = top
    on_top = jnp.where(is_sampled, keep_from > values[:, -1], values[:, 0] > NEG_INF)
    from_top = jnp.where(is_sampled, _sample_among(top, keep_from, t.seeds, positions), ids[:, 0])
    # The rows not on top: a kernel whose programs skip the others, or jnp over every row (noise_pass.py).
    rest = noise_pass_rows(x, divisor, keep_from, t.seeds, positions, is_sampled, ~on_top, f.kernels.noise_pass)
    return jnp.where(on_top, from_top, rest)


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


def threshold_and_top(x: jax.Array, divisor: jax.Array, t: SamplingTensors, f: SamplerFeatures, blocks=None):
    """For scaled = x / divisor[:, None] -> (f32[R]: each row keeps the tokens with scaled logit
    >= this, -inf keeps everything; the row's top C scaled values and their ids [R, C], or None
    with the sort method). Rows with temperature 0 get no whole-row search: their thresholds
    are those the top C give (a greedy row takes the maximum, which every truncation keeps).
    blocks: (block_max, block_sumexp) of x (logit_stats.LogitStats) or None. Dividing the
    maxima by a positive divisor gives those of scaled (rounded division is monotone).

    The top C and top_p's row mass (from the block sums) are computed whenever compiled in;
    the slow path (the mass above a min_p floor, then the whole-row search) serves the sampled
    rows not settled by their top C: their cut-off is not among them, or they have top_p and
    min_p without top_k."""
    r, v = x.shape
    none = lambda: jnp.full((r,), NEG_INF, jnp.float32)  # noqa: E731
    enabled = [name for name in ("min_p", "top_k", "top_p") if getattr(f, name)]
    if not enabled:
        return none(), None
    is_sampled = t.temperature > 0
    if f.top_k_top_p == "sort":
        return _sort_thresholds(scale_rows(x, divisor), t, f, is_sampled), None
    if blocks is None:
        blocks = block_max_and_sumexp(x, divisor)
    block_max, block_sumexp = blocks
    scaled_block_max = block_max * reciprocal(divisor)[:, None]
    top = top_n_by_blocks(scale_rows(x, divisor), min(topk_topp.TOP_CANDIDATES, v), block_max=scaled_block_max)
    desc = top[0]
    floor = topk_topp.min_p_threshold(desc[:, 0], t.min_p) if f.min_p else none()
    if not (f.top_k or f.top_p):
        return floor, top
    # Rows whose truncation keeps only tokens among the row's top few finish on those few
    # values (topk_topp.py "fast path"): top_k rows whose kept tokens all lie there (with top_p,
    # its mass is that of the kept top values), and rows that cut nothing below the floor.
    k = t.top_k if f.top_k else jnp.zeros_like(t.top_k)
    p = t.top_p if f.top_p else jnp.ones_like(t.top_p)
    k_on, p_on = topk_topp.top_k_enabled(k, v), topk_topp.top_p_enabled(p)
    settled = topk_topp.top_covers_top_k(desc, k, v) | (~k_on & ~p_on)
    total, floored = None, jnp.zeros_like(settled)
    if f.top_p:
        # The row's mass, for top_p without top_k (with top_k the mass is that of the kept top
        # values): top_p alone is settled when its top C hold mass p. It comes from the block
        # sums; with a min_p floor only the tokens above it count, which the blocks cannot
        # tell: those rows go to the slow path, which reads the row for their mass.
        total = mass_from_blocks(block_max, block_sumexp, divisor)
        floored = p_on & ~k_on & (t.min_p > 0) if f.min_p else floored
        settled |= ~k_on & ~floored & topk_topp.top_holds_top_p(desc, floor, p, total)
    fast = topk_topp.threshold_from_sorted(desc, floor, k, p, v, total)
    to_slow = ~settled & (k_on | p_on) & is_sampled

    # The whole-row pieces (slow_path.py), for the rows their top C do not settle.
    slow = slow_thresholds(x, divisor, desc, floor, k, p, total, floored, to_slow, fast, f)
    return jnp.where(to_slow, slow, fast), top


def _sort_thresholds(scaled, t: SamplingTensors, f: SamplerFeatures, is_sampled) -> jax.Array:
    """The reference: min_p from the row maximum, top_k + top_p from one sort per row."""
    r, v = scaled.shape
    floor = topk_topp.min_p_threshold(jnp.max(scaled, axis=-1), t.min_p) if f.min_p else jnp.full((r,), NEG_INF)
    if not (f.top_k or f.top_p):
        return floor
    k = t.top_k if f.top_k else jnp.zeros_like(t.top_k)
    p = t.top_p if f.top_p else jnp.ones_like(t.top_p)
    cuts = (topk_topp.top_k_enabled(k, v) | topk_topp.top_p_enabled(p)) & is_sampled
    return run_if_used(f.runtime_skip, jnp.any(cuts), lambda: topk_topp.top_k_top_p_threshold_sort(scaled, floor, k, p),
                       lambda: floor)


def sample_tokens(logits, temperature, seeds, positions) -> jax.Array:
    """Temperature-only sampling (the original entry point): logits f32[R, V]; temperature
    f32[R] (0 = greedy); seeds i32[R]; positions i32[R] -> i32[R]."""
    r = logits.shape[0]
    t = SamplingTensors.neutral(r, max_bias=0, max_stop=0, xp=jnp)
    t = dataclasses.replace(t, temperature=temperature.astype(jnp.float32), seeds=seeds.astype(jnp.int32))
    return sample(logits, t, positions, SamplerFeatures()).tokens
