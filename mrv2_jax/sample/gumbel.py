"""Gumbel noise from counter-based keys: batch composition never changes a row's randomness.

A row's noise depends only on (request seed, position of the token being sampled), so a seeded
request gets the same tokens whatever else is in the batch, whichever slot or runner it uses,
async or not. Sampling is then argmax(logits / T + noise): no softmax, no cumulative sum.
Do not change the hash: seeded outputs are expected to stay the same across versions (it last
changed on 2026-11-30, from threefry to the counter hash below).
"""

import jax
import jax.numpy as jnp
import numpy as np


# Why a counter hash and not jax.random: argmax(logits + noise) costs less with this hash
# (murmur3's 32-bit finalizer applied to (seed, position, token id)), a handful of integer ops per
# element that XLA fuses into the argmax pass, than with threefry keys made row by row
# (`python -m benchmarks.sampler --cases noise_threefry noise_hash`, which keeps the threefry
# noise, the sampler's former one, as its baseline; figures in docs/benchmarks.md).

_GOLDEN = 0x9E3779B9


def fmix32(h):
    """murmur3's 32-bit finalizer (every input bit affects every output bit); works on jnp and
    numpy uint32 arrays alike."""
    # numpy uint32 constants: a Python int this large would be taken as an (overflowing) int32.
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def gumbel_noise(seeds: jax.Array, positions: jax.Array, vocab_size: int) -> jax.Array:
    """[R, vocab] float32 Gumbel noise from a hash of (seed, position, token id) per element."""
    return gumbel_noise_at(seeds, positions, jnp.arange(vocab_size, dtype=jnp.uint32)[None, :])


def gumbel_noise_at(seeds: jax.Array, positions: jax.Array, token_ids: jax.Array) -> jax.Array:
    """The same noise at chosen token ids only: token_ids [R, C] (or [1, C]) -> f32 [R, C];
    column j of row r equals gumbel_noise(...)[r, token_ids[r, j]] bit for bit."""
    return noise_from_key(row_key(seeds, positions)[:, None], token_ids)


def row_key(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """uint32 key of each (seed, position), any matching shapes (scalars too: a Pallas kernel
    computes its row's key)."""
    u32 = jnp.uint32
    return fmix32(seeds.astype(u32) ^ fmix32(positions.astype(u32) * u32(_GOLDEN) + u32(1)))


def noise_from_key(key: jax.Array, token_ids: jax.Array) -> jax.Array:
    """f32 Gumbel noise of token ids under `key` (broadcastable): the elementwise body of every
    noise function here, also traced inside a Pallas kernel."""
    u32 = jnp.uint32
    ids = token_ids.astype(u32)
    bits = fmix32(fmix32(ids * u32(_GOLDEN) ^ key) + key)
    # u = (m + 0.5) / 2**23 from 23 bits, and 1 - u, are both exact in f32; -log(u) is taken as
    # -log1p(-(1 - u)) for u >= 1/2, where log(u) would lose the digits of the large-noise tail
    # (the tokens the argmax picks).
    m = (bits >> 9).astype(jnp.float32)
    u, one_minus_u = (m + 0.5) * 2.0**-23, ((1 << 23) - m - 0.5) * 2.0**-23
    neg_log_u = jnp.where(u < 0.5, -jnp.log(u), -jnp.log1p(-one_minus_u))
    return -jnp.log(neg_log_u)
