"""Gumbel noise from counter-based keys: batch composition never changes a row's randomness.

A row's noise depends only on (request seed, position of the token being sampled), so a seeded
request gets the same tokens whatever else is in the batch, whichever slot or runner it uses,
async or not. Sampling is then argmax(logits / T + noise): no softmax, no cumulative sum.
The noise is a counter hash (pallas_kernels/gumbel_hash.py) rather than jax.random: a handful of
integer ops per element that XLA fuses into the argmax pass, cheaper than threefry keys made
row by row (docs/benchmarks.md has the comparison; benchmarks/sampler.py keeps threefry as its baseline).
"""

import jax
import jax.numpy as jnp

from pallas_kernels.gumbel_hash import noise_from_key, row_key


def gumbel_noise(seeds: jax.Array, positions: jax.Array, vocab_size: int) -> jax.Array:
    """[R, vocab] float32 Gumbel noise from a hash of (seed, position, token id) per element."""
    return gumbel_noise_at(seeds, positions, jnp.arange(vocab_size, dtype=jnp.uint32)[None, :])


def gumbel_noise_at(seeds: jax.Array, positions: jax.Array, token_ids: jax.Array) -> jax.Array:
    """The same noise at chosen token ids only: token_ids [R, C] (or [1, C]) -> f32 [R, C];
    column j of row r equals gumbel_noise(...)[r, token_ids[r, j]] bit for bit."""
    return noise_from_key(row_key(seeds, positions)[:, None], token_ids)
