"""Logprobs of the sampled token and of the top-n tokens, without a [R, V] log-softmax.

They come from the RAW logits, before bias, penalties, temperature and truncation: vLLM's
default `logprobs_mode="raw_logprobs"`, i.e. what the model itself assigns to each token. A
full log-softmax would write another [R, V] array; only log-softmax at the (1 + n) chosen ids is
needed, which is logit - logsumexp: one reduction for logsumexp, the top n, one
count for the sampled token's rank.
The top n come from block maxima (block_top.py), not from a sort of the whole row.

rank = 1 + number of tokens with a strictly larger logit (vLLM's definition; the top-n entries
get ranks 1..n). Rows that asked for no logprobs get values too: callers read only the rows and
columns they need.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mrv2_jax.sample.block_top import top_n_by_blocks


class Logprobs(NamedTuple):
    logprobs: jax.Array  # f32[R, 1 + n]: column 0 = the sampled token, then the top n
    token_ids: jax.Array  # i32[R, 1 + n]
    sampled_rank: jax.Array  # i32[R]


def compute_logprobs(raw_logits: jax.Array, tokens: jax.Array, num_top: int) -> Logprobs:
    raw = raw_logits.astype(jnp.float32)
    top_values = top_ids = None
    if num_top > 0:
        top_values, top_ids = top_n_by_blocks(raw, num_top)
    # logsumexp, with the row maximum taken from the top n when there is one (jax.nn.logsumexp
    # would read the row once more for it).
    row_max = top_values[:, 0] if num_top > 0 else jnp.max(raw, axis=-1)
    shift = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    lse = shift + jnp.log(jnp.sum(jnp.exp(raw - shift[:, None]), axis=-1))
    sampled = jnp.take_along_axis(raw, tokens[:, None], axis=1)  # [R, 1]
    rank = 1 + jnp.sum(raw > sampled, axis=-1, dtype=jnp.int32)
    values, ids = sampled, tokens[:, None].astype(jnp.int32)
    if num_top > 0:
        values = jnp.concatenate([values, top_values], axis=1)
        ids = jnp.concatenate([ids, top_ids.astype(jnp.int32)], axis=1)
    return Logprobs(values - lse[:, None], ids, rank)


def empty_logprobs(num_rows: int, num_top: int) -> Logprobs:
    """What a step returns when no row asked for logprobs (same shapes, no work)."""
    return Logprobs(jnp.zeros((num_rows, 1 + num_top), jnp.float32),
                    jnp.zeros((num_rows, 1 + num_top), jnp.int32), jnp.zeros((num_rows,), jnp.int32))
