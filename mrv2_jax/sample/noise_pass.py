"""The whole-row noise pass: argmax over each row of (processed / temperature, cut below the
row's threshold, plus its Gumbel noise); greedy rows take the argmax of the processed logits.

The sampler runs it only for rows whose top candidates do not settle their token (sampler.py).
Under `lax.cond` ("cond", the default) the pass is skipped when no row needs it; but a
conditional inside the step costs far more than its microbenchmark (docs/benchmarks.md,
"Sampler: bf16 logits, and what the conditionals cost"). `MRV2_SAMPLER_NOISE_PASS=kernel` runs a
Pallas kernel instead (pallas_kernels/noise_pass.py), unconditionally: its programs skip the
rows that need nothing, so with no such row it costs one launch, and with some it reads only
those rows. Not the default until measured on a GPU (gpu_check.sh ab-s1-conditionals).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from mrv2_jax.sample.gumbel import gumbel_noise
from mrv2_jax.sample.logit_stats import fits_int32_offsets

MODES = ("cond", "kernel", "interpret")
NEG_INF = -jnp.inf


def noise_pass_mode() -> str:
    """MRV2_SAMPLER_NOISE_PASS: "cond" (default), "kernel" (the Pallas kernel on GPUs, the
    reference elsewhere, no conditional either way) or "interpret" (the kernel in the Pallas
    interpreter: CPU tests)."""
    mode = os.environ.get("MRV2_SAMPLER_NOISE_PASS", "cond")
    if mode not in MODES:
        raise ValueError(f"MRV2_SAMPLER_NOISE_PASS must be one of {MODES}, got {mode!r}")
    return mode


def noise_pass_reference(x, divisor, keep_from, seeds, positions, is_sampled) -> jax.Array:
    """x f32[R, V] processed logits; divisor, keep_from f32[R]; is_sampled bool[R] -> i32[R]."""
    scaled = x / divisor[:, None]
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
