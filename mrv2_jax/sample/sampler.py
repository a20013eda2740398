"""Token sampling on the device, inside the jitted step.

Randomness is counter-based: a row's Gumbel noise comes from a key derived from (request seed,
position of the token being sampled) only, so a seeded request gets the same tokens whatever
else is in the batch, whichever slot or runner it uses, async or not. Greedy rows
(temperature 0) take the argmax and need no noise.
"""

import jax
import jax.numpy as jnp


def gumbel_noise(seeds: jax.Array, positions: jax.Array, vocab_size: int) -> jax.Array:
    """[R, vocab] float32 Gumbel noise keyed by (seed, position) per row."""
    def row(seed, pos):
        key = jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), pos)
        return jax.random.gumbel(key, (vocab_size,), jnp.float32)

    return jax.vmap(row)(seeds, positions)


def sample_tokens(logits, temperature, seeds, positions) -> jax.Array:
    """logits f32[R, V]; temperature f32[R]; seeds int32[R]; positions int32[R] -> int32[R]."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def with_noise(_):
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        noisy = scaled + gumbel_noise(seeds, positions, logits.shape[-1])
        return jnp.where(temperature > 0, jnp.argmax(noisy, axis=-1).astype(jnp.int32), greedy)

    # An all-greedy batch skips the noise entirely.
    return jax.lax.cond(jnp.any(temperature > 0), with_noise, lambda _: greedy, None)
