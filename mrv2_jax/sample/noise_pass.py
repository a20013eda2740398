"""The whole-row noise pass: argmax over each row of (processed / temperature, cut below the
row's threshold, plus its Gumbel noise); greedy rows take the argmax of the processed logits.

The sampler runs it only for rows whose top candidates do not settle their token (sampler.py),
and skips the others in one of two ways (`MRV2_SAMPLER_NOISE_PASS`, features.whole_row_pass_mode):
under one `lax.cond` that skips the pass when no row needs it ("cond", the default off GPUs), or
as a Pallas kernel (pallas_kernels/noise_pass.py) run unconditionally, whose programs skip the
rows that need nothing: with no such row it costs one launch, and with some it reads only those
rows ("kernel", the default on GPUs, where a conditional inside the step costs far more than its
microbenchmark: docs/benchmarks.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mrv2_jax.sample.features import whole_row_pass_mode
from mrv2_jax.sample.gumbel import gumbel_noise
from mrv2_jax.sample.logit_stats import fits_int32_offsets, scale_rows

NEG_INF = -jnp.inf


def noise_pass_mode() -> str:
    """MRV2_SAMPLER_NOISE_PASS: "auto", "cond", "kernel" or "interpret" (features.py)."""
    return whole_row_pass_mode("MRV2_SAMPLER_NOISE_PASS")


def noise_pass_reference(x, divisor, keep_from, seeds, positions, is_sampled) -> jax.Array:
    """x f32[R, V] processed logits; divisor, keep_from f32[R]; is_sampled bool[R] -> i32[R]."""
    scaled = scale_rows(x, divisor)
    noisy = jnp.where(scaled >= keep_from[:, None], scaled, NEG_INF)
    noisy = noisy + gumbel_noise(seeds, positions, x.shape[-1])
    return jnp.argmax(jnp.where(is_sampled[:, None], noisy, x), axis=-1).astype(jnp.int32)


def noise_pass_rows(x, divisor, keep_from, seeds, positions, is_sampled, needed) -> jax.Array:
    """The pass at the `needed` rows (bool[R]; others: any value), with no conditional."""
    mode = noise_pass_mode()
    if fits_int32_offsets(x) and (mode == "interpret" or (mode == "kernel" and jax.default_backend() == "gpu")):
        from pallas_kernels.noise_pass import noise_pass as kernel

        return kernel(x, divisor, keep_from, seeds, positions, is_sampled, needed, interpret=mode == "interpret")
    return noise_pass_reference(x, divisor, keep_from, seeds, positions, is_sampled)
