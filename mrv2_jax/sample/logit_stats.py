"""One read of the logits for everything the sampler needs from the whole row.

Per row, the sampler needs the penalised logits, the maxima of blocks of `BLOCK` ids (of the
penalised logits, for the top candidates: block_top.py; of the raw logits, for the top-n
logprobs), the raw row's logsumexp (logprobs.py) and top_p's mass, the sum of
exp((x - max) / temperature) over the penalised row (sampler.py). As separate XLA fusions
these were five passes over [R, V] on an H200 (256 x 151,936): the penalty pass with the
penalised block maxima fused in (108 us), the raw block maxima (44 us), top_p's mass (45 us)
and logsumexp with the sampled token's rank (44 us). `logit_stats` computes them in one pass: a Pallas kernel on GPUs
(pallas_kernels/logit_stats.py), the jnp reference below elsewhere.

logsumexp comes from per-block partial sums: with m_b the block maximum and
s_b = sum over the block of exp(x - m_b), logsumexp = M + log(sum_b exp(m_b - M) * s_b),
M = max_b m_b (the online-softmax identity), so no pass needs the row maximum first; top_p's
mass likewise, with the differences divided by the row's temperature.

`count_above` is the rank's count (tokens with a larger raw logit than the sampled one): with
the block maxima known, a block whose maximum is not above the threshold holds nothing to
count, and the kernel skips reading it; in a decode step nearly every block is skipped.

The kernels run when `kernel_mode()` says so: on GPUs by default; `MRV2_SAMPLER_KERNELS=off`
forces the jnp reference (for A/B runs), `=interpret` runs the kernels in the Pallas
interpreter (CPU tests).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mrv2_jax.sample.penalties import PenaltyData, apply_penalties
from mrv2_jax.sample.tensors import SamplingTensors

BLOCK = 128  # ids per block; block_top.DEFAULT_BLOCKS[0] must match
KERNEL_MODES = ("auto", "off", "interpret")


class LogitStats(NamedTuple):
    processed: jax.Array  # f32[R, V]: after penalties (the raw logits when there are none)
    block_max: jax.Array  # f32[R, NB]: max of `processed` over ids [b * BLOCK, (b + 1) * BLOCK)
    block_sumexp: jax.Array  # f32[R, NB]: sum of exp((processed - block_max) / divisor)
    raw_block_max: jax.Array  # f32[R, NB]: the same for the raw logits
    raw_block_sumexp: jax.Array  # f32[R, NB]: sum of exp(raw - raw_block_max) (0: all -inf)


def num_blocks(vocab_size: int) -> int:
    return -(-vocab_size // BLOCK)


def kernel_mode() -> str | None:
    """None (jnp), "gpu" (compiled kernels) or "interpret", from MRV2_SAMPLER_KERNELS."""
    mode = os.environ.get("MRV2_SAMPLER_KERNELS", "auto")
    if mode not in KERNEL_MODES:
        raise ValueError(f"MRV2_SAMPLER_KERNELS must be one of {KERNEL_MODES}, got {mode!r}")
    if mode == "auto":
        return "gpu" if jax.default_backend() == "gpu" else None
    return None if mode == "off" else "interpret"


def logit_stats(logits: jax.Array, t: SamplingTensors | None, penalties: PenaltyData | None,
                divisor: jax.Array | None = None) -> LogitStats:
    """logits [R, V] (any float dtype); penalties None: no penalty pass; divisor f32[R] > 0
    (the rows' temperatures, 1 for greedy rows; None: 1) scales block_sumexp."""
    if divisor is None:
        divisor = jnp.ones(logits.shape[:1], jnp.float32)
    mode = kernel_mode()
    tables = (logits,) if penalties is None else (logits, penalties.output_counts)
    if mode is None or not fits_int32_offsets(*tables):
        return logit_stats_reference(logits, t, penalties, divisor)
    from pallas_kernels.logit_stats import logit_stats as kernel

    return kernel(logits, t, penalties, divisor, interpret=mode == "interpret")


def fits_int32_offsets(*arrays) -> bool:
    """The kernels address flattened arrays with int32 offsets; larger tables take the jnp path."""
    return all(math.prod(a.shape) < 2**31 for a in arrays)


def reciprocal(divisor: jax.Array) -> jax.Array:
    """f32 1 / divisor. The sampler scales rows by multiplying with it (`scale_rows`), as XLA's
    algebraic simplifier would turn x / divisor[:, None] into anyway, and the kernels that
    compare their values with the sampler's (noise pass, threshold search) take it as an input:
    Triton's own division rounds differently, and a threshold must compare exactly."""
    return jnp.float32(1) / divisor.astype(jnp.float32)


def scale_rows(x: jax.Array, divisor: jax.Array) -> jax.Array:
    """x [R, V] / divisor [R], computed as x * reciprocal(divisor) (see there)."""
    return x * reciprocal(divisor)[:, None]


def logit_stats_reference(logits: jax.Array, t: SamplingTensors | None, penalties: PenaltyData | None,
                          divisor: jax.Array) -> LogitStats:
    raw = logits.astype(jnp.float32)
    processed = raw if penalties is None else apply_penalties(raw, t, penalties)
    raw_max, raw_sumexp = block_max_and_sumexp(raw)
    block_max, block_sumexp = block_max_and_sumexp(processed, divisor)
    return LogitStats(processed, block_max, block_sumexp, raw_max, raw_sumexp)


def block_max_and_sumexp(x: jax.Array, divisor: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x f32[R, V] -> per block of BLOCK ids: (max, sum of exp((x - max) / divisor)), each
    f32[R, NB]; divisor f32[R] (None: 1)."""
    r, v = x.shape
    nb = num_blocks(v)
    blocks = jnp.pad(x, ((0, 0), (0, nb * BLOCK - v)), constant_values=-jnp.inf).reshape(r, nb, BLOCK)
    m = jnp.max(blocks, axis=-1)
    return m, _sumexp(blocks, m, divisor)


def _sumexp(blocks: jax.Array, block_max: jax.Array, divisor: jax.Array | None) -> jax.Array:
    shifted = blocks - jnp.where(block_max == -jnp.inf, 0.0, block_max)[..., None]
    if divisor is not None:
        shifted = shifted / divisor[:, None, None]
    return jnp.sum(jnp.exp(shifted), axis=-1)


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


def count_above(logits: jax.Array, block_max: jax.Array, threshold: jax.Array) -> jax.Array:
    """i32[R]: the number of entries of each row of logits [R, V] greater than threshold f32[R];
    block_max f32[R, NB] are the rows' block maxima (what lets the kernel skip blocks)."""
    mode = kernel_mode()
    if mode is None or not fits_int32_offsets(logits):
        return jnp.sum(logits.astype(jnp.float32) > threshold[:, None], axis=-1, dtype=jnp.int32)
    from pallas_kernels.logit_stats import count_above as kernel

    return kernel(logits, block_max, threshold, interpret=mode == "interpret")


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
    fresh_sumexp = _sumexp(windows, fresh_max, divisor)
    rows = jnp.broadcast_to(jnp.arange(values.shape[0])[:, None], ids.shape)
    return (block_max.at[rows, block].set(fresh_max, mode="drop"),
            block_sumexp.at[rows, block].set(fresh_sumexp, mode="drop"))
