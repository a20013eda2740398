"""One read of the logits for everything the sampler needs from the whole row.

Per row, the sampler needs the penalised logits, the maxima of blocks of `BLOCK` ids (of the
penalised logits, for the top candidates: block_top.py; of the raw logits, for the top-n
logprobs), the raw row's logsumexp (logprobs.py) and top_p's mass, the sum of
exp((x - max) / temperature) over the penalised row (sampler.py). As separate XLA fusions these
were five passes over [R, V] (docs/benchmarks.md, "Sampler: one pass over the logits");
`logit_stats` computes them in one: the Pallas kernel of pallas_kernels/logit_stats.py, or its
jnp reference. This module adapts the engine's types (SamplingTensors, PenaltyData) to the
kernel's arrays.

logsumexp comes from per-block partial sums: with m_b the block maximum and
s_b = sum over the block of exp(x - m_b), logsumexp = M + log(sum_b exp(m_b - M) * s_b),
M = max_b m_b (the online-softmax identity), so no pass needs the row maximum first; top_p's
mass likewise, with the differences divided by the row's temperature.

`count_above` is the rank's count (tokens with a larger raw logit than the sampled one): with
the block maxima known, a block whose maximum is not above the threshold holds nothing to
count, and the kernel skips reading it; in a decode step nearly every block is skipped.

`mode` (static, SamplerKernels.logit_stats): "kernel" (the compiled kernels: GPUs), "interpret"
(the kernels in the Pallas interpreter: CPU tests) or "reference" (the jnp reference).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mrv2_jax.sample.penalties import PenaltyData, penalty_arrays
from mrv2_jax.sample.tensors import SamplingTensors
from pallas_kernels import logit_stats as kernels
from pallas_kernels.logit_stats import LogitStats
from pallas_kernels.sampler_common import BLOCK, block_max_and_sumexp, fits_int32_offsets, num_blocks, sumexp_of_blocks

__all__ = ["BLOCK", "LogitStats", "block_max_and_sumexp", "count_above", "logit_stats", "logit_stats_reference",
           "logsumexp_from_blocks", "mass_from_blocks", "num_blocks", "refresh_blocks"]


def logit_stats(logits: jax.Array, t: SamplingTensors | None, penalties: PenaltyData | None,
                divisor: jax.Array | None = None, mode: str = "reference") -> LogitStats:
    """logits [R, V] (any float dtype); penalties None: no penalty pass; divisor f32[R] > 0
    (the rows' temperatures, 1 for greedy rows; None: 1) scales block_sumexp."""
    if divisor is None:
        divisor = jnp.ones(logits.shape[:1], jnp.float32)
    arrays = None if penalties is None else penalty_arrays(t, penalties)
    tables = (logits,) if penalties is None else (logits, penalties.output_counts)
    if mode == "reference" or not fits_int32_offsets(*tables):
        return kernels.logit_stats_reference(logits, divisor, arrays)
    return kernels.logit_stats(logits, divisor, arrays, interpret=mode == "interpret")


def logit_stats_reference(logits: jax.Array, t: SamplingTensors | None, penalties: PenaltyData | None,
                          divisor: jax.Array) -> LogitStats:
    """The jnp pass on the engine's types (benchmarks and tests compare the kernels with it)."""
    return kernels.logit_stats_reference(logits, divisor, None if penalties is None else penalty_arrays(t, penalties))


def mass_from_blocks(block_max: jax.Array, block_sumexp: jax.Array, divisor: jax.Array) -> jax.Array:
    """f32[R]: sum over the row of exp((x - max) / divisor) (top_p's total without a floor),
    from the blocks' maxima and their sums of exp((x - block max) / divisor)."""
    return _combine_blocks(block_max, block_sumexp, divisor)[1]


def logsumexp_from_blocks(block_max: jax.Array, block_sumexp: jax.Array) -> jax.Array:
    """f32[R]: the rows' logsumexp from their blocks' (max, sum of exp(x - max))."""
    shift, total = _combine_blocks(block_max, block_sumexp, None)
    return shift + jnp.log(total)


def _combine_blocks(block_max, block_sumexp, divisor):
    """(shift, sum over blocks of exp((m_b - shift) / divisor) * s_b): shift is the row maximum
    (0 for a row of -inf)."""
    row_max = jnp.max(block_max, axis=-1)
    shift = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    scaled = block_max - shift[:, None]
    if divisor is not None:
        scaled = scaled / divisor[:, None]
    return shift, jnp.sum(jnp.exp(scaled) * block_sumexp, axis=-1)


def count_above(logits: jax.Array, block_max: jax.Array, threshold: jax.Array, mode: str = "reference") -> jax.Array:
    """i32[R]: the number of entries of each row of logits [R, V] greater than threshold f32[R];
    block_max f32[R, NB] are the rows' block maxima (what lets the kernel skip blocks)."""
    if mode == "reference" or not fits_int32_offsets(logits):
        return kernels.count_above_reference(logits, block_max, threshold)
    return kernels.count_above(logits, block_max, threshold, interpret=mode == "interpret")


def refresh_blocks(block_max: jax.Array, block_sumexp: jax.Array, values: jax.Array, ids: jax.Array,
                   divisor: jax.Array) -> tuple[jax.Array, jax.Array]:
    """block_max and block_sumexp after the entries `ids` [R, E] of `values` [R, V] were edited:
    the blocks holding them are computed again (ids >= V: nothing). Sparse edits touch a few ids
    per row, so this reads E blocks per row instead of the row."""
    v = values.shape[1]
    width = min(BLOCK, v)
    block = ids // BLOCK  # an id >= V names no block or the last one: recomputing it is harmless
    # One slice of `width` ids per edit, moved left where the last block is short (a gather of
    # [R, E] windows: with an index per element it was a 84 MB index array at 256 x 320).
    start = jnp.clip(block * BLOCK, 0, v - width)
    windows = jax.vmap(jax.vmap(lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, width), (None, 0)))(values, start)
    windows = jnp.where((start[..., None] + jnp.arange(width)) // BLOCK == block[..., None], windows, -jnp.inf)
    fresh_max = jnp.max(windows, axis=-1)
    fresh_sumexp = sumexp_of_blocks(windows, fresh_max, divisor)
    rows = jnp.broadcast_to(jnp.arange(values.shape[0])[:, None], ids.shape)
    return (block_max.at[rows, block].set(fresh_max, mode="drop"),
            block_sumexp.at[rows, block].set(fresh_sumexp, mode="drop"))
