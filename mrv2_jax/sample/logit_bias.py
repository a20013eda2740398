"""Sparse logit edits: logit_bias, and min_tokens (EOS / stop ids forbidden for now).

Both touch a handful of ids per row, so both are scatters of [R, MB] / [R, MS] updates instead
of passes over the vocabulary: bias values add, forbidden ids are set to -inf. Padding ids (-1)
and inactive stop ids are sent past the end of the row, where `mode="drop"` discards them (a
negative index would wrap around instead).

When penalties also run, the penalty pass writes a fresh [R, V] array anyway, and the edits are
applied to it afterwards (`edit_after_penalties`) so the raw logits never need a copy: a biased
id gets penalty(raw + bias), computed from the gathered raw values, which is exactly what
"bias, then penalties" gives; and -inf stays -inf under every penalty, so the min_tokens mask
commutes with them.
"""

import jax
import jax.numpy as jnp

from mrv2_jax.sample.penalties import PenaltyData, penalize_at
from mrv2_jax.sample.tensors import SamplingTensors


def _in_vocab(ids: jax.Array, vocab_size: int) -> jax.Array:
    return jnp.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)


def bias_ids(t: SamplingTensors, vocab_size: int) -> jax.Array:
    return _in_vocab(t.bias_ids, vocab_size)


def forbidden_ids(t: SamplingTensors, vocab_size: int) -> jax.Array:
    """Stop ids of rows that have fewer than min_tokens outputs (others: dropped)."""
    active = (t.num_output_tokens < t.min_tokens)[:, None]
    return _in_vocab(jnp.where(active, t.stop_ids, -1), vocab_size)


def _rows(ids: jax.Array) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)


def apply_sparse_edits(logits: jax.Array, t: SamplingTensors, *, bias: bool = True,
                       min_tokens: bool = True) -> jax.Array:
    v = logits.shape[-1]
    if bias:
        ids = bias_ids(t, v)
        logits = logits.at[_rows(ids), ids].add(t.bias_values, mode="drop")
    if min_tokens:
        ids = forbidden_ids(t, v)
        logits = logits.at[_rows(ids), ids].set(-jnp.inf, mode="drop")
    return logits


def edit_after_penalties(penalized: jax.Array, raw: jax.Array, t: SamplingTensors, data: PenaltyData,
                         *, bias: bool = True, min_tokens: bool = True) -> jax.Array:
    """The same result as penalties(apply_sparse_edits(raw)), from penalties(raw)."""
    v = raw.shape[-1]
    if bias:
        ids = bias_ids(t, v)
        rows = _rows(ids)
        biased = raw.at[rows, ids].get(mode="fill", fill_value=0.0).astype(jnp.float32) + t.bias_values
        penalized = penalized.at[rows, ids].set(penalize_at(biased, t, data, ids), mode="drop")
    if min_tokens:
        ids = forbidden_ids(t, v)
        penalized = penalized.at[_rows(ids), ids].set(-jnp.inf, mode="drop")
    return penalized


def edited_ids(t: SamplingTensors, features, vocab_size: int) -> jax.Array:
    """i32[R, E]: every id the compiled edits may change (>= vocab_size: none), for
    logit_stats.refresh_blocks."""
    ids = []
    if features.logit_bias:
        ids.append(bias_ids(t, vocab_size))
    if features.min_tokens:
        ids.append(forbidden_ids(t, vocab_size))
    return jnp.concatenate(ids, axis=1)
