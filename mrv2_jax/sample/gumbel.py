"""Gumbel noise from counter-based keys: batch composition never changes a row's randomness.

A row's noise depends only on (request seed, position of the token being sampled), so a seeded
request gets the same tokens whatever else is in the batch, whichever slot or runner it uses,
async or not. Sampling is then argmax(logits / T + noise): no softmax, no cumulative sum.
Do not change the key derivation: seeded outputs are expected to stay the same across versions.
"""

import jax
import jax.numpy as jnp


def gumbel_noise(seeds: jax.Array, positions: jax.Array, vocab_size: int) -> jax.Array:
    """[R, vocab] float32 Gumbel noise keyed by (seed, position) per row."""
    def row(seed, pos):
        key = jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), pos)
        return jax.random.gumbel(key, (vocab_size,), jnp.float32)

    return jax.vmap(row)(seeds, positions)
