"""The target's half of a spec step: score every draft position, sample, verify.

Row r's scheduled tokens end with its last known token followed by `num_draft[r]` drafts. The
logits of those 1 + n positions are computed (index j = 0..n; rows without drafts just their
last token, as without speculation), the usual sampler samples each of them with the row's
parameters (as if it were the request's next token there: min_tokens counts the j outputs
before it, Gumbel noise is keyed by its own position), and rejection.py decides how many
drafts to keep. Rows that use penalties or logprobs are never given drafts by the scheduler,
so index 0 carries their one token exactly as without speculation.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mrv2_jax.runner.device_state import DeviceState
from mrv2_jax.sample.penalties import PenaltyData
from mrv2_jax.sample.sampler import adjust_logits, sample, truncation_threshold
from mrv2_jax.sample.tensors import SamplingTensors
from mrv2_jax.spec_decode import rejection


class SpecSamplerOutput(NamedTuple):
    tokens: jax.Array  # i32[R, 1 + k]; row r emits tokens[r, :num_sampled[r]]
    num_sampled: jax.Array  # i32[R]: accepted drafts + 1 (rows that do not sample: ignore)
    num_accepted: jax.Array  # i32[R]
    logprobs: jax.Array | None = None  # of index 0 (rows asking for logprobs have no drafts)
    logprob_token_ids: jax.Array | None = None
    sampled_rank: jax.Array | None = None


def verify_indices(query_start_loc, num_draft, k: int):
    """i32[R, 1 + k]: flattened-token index scored at each j (j > n repeats index n)."""
    last = query_start_loc[1:] - 1
    j = jnp.arange(k + 1)[None, :]
    return jnp.maximum(last[:, None] - num_draft[:, None] + jnp.minimum(j, num_draft[:, None]), 0)


def expand_rows(t: SamplingTensors, k: int) -> SamplingTensors:
    """Each row's sampler values repeated for its 1 + k positions; index j has j more outputs."""
    rep = lambda a: None if a is None else jnp.repeat(a, k + 1, axis=0)  # noqa: E731
    t = jax.tree.map(rep, t)
    offsets = jnp.tile(jnp.arange(k + 1, dtype=jnp.int32), t.num_rows // (k + 1))
    return dataclasses.replace(t, num_output_tokens=t.num_output_tokens + offsets)


def sampling_probs(logits, t: SamplingTensors, features, penalties, sampled_tokens):
    """The distribution the sampler draws from, per row: bias / penalties, temperature and
    truncation applied, softmax; greedy rows: one-hot at their pick."""
    x = logits.astype(jnp.float32)
    if features.logit_bias or features.min_tokens or features.penalties:
        x = adjust_logits(x, t, features, penalties)
    is_sampled = t.temperature > 0
    scaled = x / jnp.where(is_sampled, t.temperature, 1.0)[:, None]
    keep_from = truncation_threshold(scaled, t, features)
    probs = jax.nn.softmax(jnp.where(scaled >= keep_from[:, None], scaled, -jnp.inf), axis=-1)
    return jnp.where(is_sampled[:, None], probs, jax.nn.one_hot(sampled_tokens, x.shape[-1], dtype=probs.dtype))


def sample_and_verify(lm, hidden, *, input_ids, positions, query_start_loc, num_draft, sampling: SamplingTensors,
                      features, penalties: PenaltyData | None, config, draft_probs=None) -> SpecSamplerOutput:
    """hidden [T, H] of the target forward pass -> the step's verified tokens."""
    k = config.num_speculative_tokens
    r = num_draft.shape[0]
    index = verify_indices(query_start_loc, num_draft, k)
    logits = lm.compute_logits(hidden[index.reshape(-1)])  # [R * (1 + k), V]
    sample_pos = positions[index] + 1  # position of the token sampled at each index
    t = expand_rows(sampling, k)
    if penalties is not None:
        penalties = dataclasses.replace(penalties, rows=jnp.repeat(penalties.rows, k + 1))
    out = sample(logits, t, sample_pos.reshape(-1), features, penalties)
    target = out.tokens.reshape(r, k + 1)
    drafts = input_ids[index[:, 1:]]
    seeds = sampling.seeds
    if config.method == "synthetic":
        tokens, accepted = rejection.synthetic(target, drafts, num_draft, seeds, sample_pos, config.acceptance_rate)
    elif config.rejection_sampling == "probabilistic" and features.sampling:
        probs = sampling_probs(logits, t, features, penalties, out.tokens).reshape(r, k + 1, -1)
        tokens, accepted = rejection.probabilistic(target, probs, drafts, draft_probs, num_draft, seeds, sample_pos)
    else:  # strict, or an all-greedy batch (where both rules agree)
        tokens, accepted = rejection.strict(target, drafts, num_draft)
    first = lambda a: None if a is None else a.reshape(r, k + 1, *a.shape[1:])[:, 0]  # noqa: E731
    return SpecSamplerOutput(tokens, accepted + 1, accepted, first(out.logprobs), first(out.logprob_token_ids),
                             first(out.sampled_rank))


def post_update(state: DeviceState, idx_mapping, num_reqs, inputs, out: SpecSamplerOutput, num_draft) -> DeviceState:
    """prepare.post_update for spec steps: a sampling row keeps its accepted drafts and one more
    token; num_computed covers the positions whose KV holds final tokens (the last known token's
    KV is computed by the next step, as without speculation; rejected drafts' KV is stale and is
    overwritten then)."""
    s = state.token_ids.shape[0]
    r, width = out.tokens.shape
    real_row = jnp.arange(r) < num_reqs
    first = inputs.seq_lens - num_draft  # position of the first token sampled by a row
    computed = jnp.where(inputs.samples, first + out.num_accepted, inputs.seq_lens)
    sample_rows = jnp.where(inputs.samples, idx_mapping, s)
    j = jnp.arange(width)[None, :]
    keep = inputs.samples[:, None] & (j <= out.num_accepted[:, None])
    rows = jnp.where(keep, idx_mapping[:, None], s)
    token_ids = state.token_ids.at[rows, first[:, None] + j].set(out.tokens, mode="drop")
    scalars = (state.scalars.set_at("num_computed", jnp.where(real_row, idx_mapping, s), computed)
               .set_at("num_tokens", sample_rows, first + out.num_sampled))
    return state._replace(token_ids=token_ids, scalars=scalars)


def num_drafts_of_rows(state: DeviceState, idx_mapping, inputs, k: int):
    """Drafts each row carries this step, from the tables alone: tokens scheduled past the
    row's known tokens (the scheduler gives decode rows 1 + n tokens)."""
    n = inputs.seq_lens - state.num_tokens[idx_mapping]
    return jnp.where(inputs.samples, jnp.clip(n, 0, k), 0).astype(jnp.int32)
