"""Logprobs of the sampled token and of the top-n tokens, without a [R, V] log-softmax.

They come from the RAW logits, before bias, penalties, temperature and truncation: vLLM's
default `logprobs_mode="raw_logprobs"`, i.e. what the model itself assigns to each token. A
full log-softmax would write another [R, V] array; only log-softmax at the (1 + n) chosen ids is
needed, which is logit - logsumexp. logsumexp and the block maxima that the top n start from
(block_top.py: no sort of the whole row) come from the sampler's one pass over the logits
(logit_stats.py); the sampled token's rank counts only blocks whose maximum is above it.

rank = 1 + number of tokens with a strictly larger logit (vLLM's definition; the top-n entries
get ranks 1..n). Rows that asked for no logprobs get values too: callers read only the rows and
columns they need.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mrv2_jax.sample.block_top import top_n_by_blocks
from mrv2_jax.sample.logit_stats import count_above, logit_stats, logsumexp_from_blocks


class Logprobs(NamedTuple):
    logprobs: jax.Array  # f32[R, 1 + n]: column 0 = the sampled token, then the top n
    token_ids: jax.Array  # i32[R, 1 + n]
    sampled_rank: jax.Array  # i32[R]


def compute_logprobs(raw_logits: jax.Array, tokens: jax.Array, num_top: int,
                     stats: tuple[jax.Array, jax.Array] | None = None, kernel_mode: str = "reference") -> Logprobs:
    """stats: the raw logits' (block maxima, block sums of exp(x - max)) when the caller has
    them (logit_stats.LogitStats); otherwise they are computed here. kernel_mode:
    SamplerKernels.logit_stats, for the pass and the rank count."""
    if stats is None:
        stats = raw_block_stats(raw_logits, kernel_mode)
    block_max, block_sumexp = stats
    lse = logsumexp_from_blocks(block_max, block_sumexp)
    # Gathers from the logits in their own dtype, converted after (exact: f32 holds any bf16):
    # reading through an f32 copy made XLA write that copy out first (docs/benchmarks.md).
    sampled = jnp.take_along_axis(raw_logits, tokens[:, None], axis=1).astype(jnp.float32)  # [R, 1]
    rank = 1 + count_above(raw_logits, block_max, sampled[:, 0], kernel_mode)
    values, ids = sampled, tokens[:, None].astype(jnp.int32)
    if num_top > 0:
        top_values, top_ids = top_n_by_blocks(raw_logits, num_top, block_max=block_max)
        values = jnp.concatenate([values, top_values.astype(jnp.float32)], axis=1)
        ids = jnp.concatenate([ids, top_ids.astype(jnp.int32)], axis=1)
    return Logprobs(values - lse[:, None], ids, rank)


def raw_block_stats(raw_logits: jax.Array, kernel_mode: str = "reference") -> tuple[jax.Array, jax.Array]:
    """(block maxima, block sums of exp(x - max)) of raw logits [R, V]: logit_stats without
    penalties."""
    stats = logit_stats(raw_logits, None, None, mode=kernel_mode)
    return stats.raw_block_max, stats.raw_block_sumexp


def empty_logprobs(num_rows: int, num_top: int) -> Logprobs:
    """What a step returns when no row asked for logprobs (same shapes, no work)."""
    return Logprobs(jnp.zeros((num_rows, 1 + num_top), jnp.float32),
                    jnp.zeros((num_rows, 1 + num_top), jnp.int32), jnp.zeros((num_rows,), jnp.int32))
