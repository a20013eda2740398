"""The whole-row noise pass: argmax over each row of (processed / temperature, cut below the
row's threshold, plus its Gumbel noise); greedy rows take the argmax of the processed logits.

The sampler needs it only for rows whose top candidates do not settle their token (sampler.py).
On GPUs it runs as a Pallas kernel (pallas_kernels/noise_pass.py) whose programs skip the rows
that need nothing, with no conditional: with no such row it costs one launch. Elsewhere the jnp
reference runs over every row (SamplerKernels.noise_pass).
"""

from __future__ import annotations

import jax

from pallas_kernels import noise_pass as kernels
from pallas_kernels.noise_pass import noise_pass_reference
from pallas_kernels.sampler_common import fits_int32_offsets

__all__ = ["noise_pass_reference", "noise_pass_rows"]


def noise_pass_rows(x, divisor, keep_from, seeds, positions, is_sampled, needed, mode: str) -> jax.Array:
    """The pass at the `needed` rows (bool[R]; others: any value), with no conditional; mode:
    SamplerKernels.noise_pass."""
    if mode == "reference" or not fits_int32_offsets(x):
        return noise_pass_reference(x, divisor, keep_from, seeds, positions, is_sampled)
    return kernels.noise_pass(x, divisor, keep_from, seeds, positions, is_sampled, needed,
                              interpret=mode == "interpret")
