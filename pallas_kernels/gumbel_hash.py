"""The counter hash behind the sampler's Gumbel noise: (seed, position, token id) -> f32 noise.

Pure jnp, so that the engine's sampler (mrv2_jax/sample/gumbel.py) and the kernels that add the
noise inside a program (noise_pass.py) run the same expression and get the same bits.
The hash is murmur3's 32-bit finalizer; seeded outputs depend on it, so it must not change.
"""

import jax
import jax.numpy as jnp
import numpy as np

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


def row_key(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """uint32 key of each (seed, position), any matching shapes (scalars too: a Pallas kernel
    computes its row's key)."""
    u32 = jnp.uint32
    return fmix32(seeds.astype(u32) ^ fmix32(positions.astype(u32) * u32(_GOLDEN) + u32(1)))


def noise_from_key(key: jax.Array, token_ids: jax.Array) -> jax.Array:
    """f32 Gumbel noise of token ids under `key` (broadcastable): the elementwise body of the
    sampler's noise, also traced inside a Pallas kernel."""
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
