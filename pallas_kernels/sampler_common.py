"""What the sampler kernels share with each other and with the engine's sampler (mrv2_jax/sample/):
the block layout of a row, the int32 addressing limit, the reciprocal that scales rows, the
penalty formula, and the tiling of a row inside a kernel program.

Both sides import these from here, so that a kernel and the jnp path it replaces compute the same
bits: a threshold found by a kernel must compare exactly with the sampler's scaled values.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

BLOCK = 128  # ids per block of a row (block maxima and sums); mrv2_jax/sample/block_top.py's first level
WORD = 32  # ids per prompt-mask word
NEG_INF = float("-inf")


def num_blocks(vocab_size: int) -> int:
    return -(-vocab_size // BLOCK)


def num_mask_words(vocab_size: int) -> int:
    return -(-vocab_size // WORD)


def fits_int32_offsets(*arrays) -> bool:
    """The kernels address flattened arrays with int32 offsets; larger tables take the jnp path."""
    return all(math.prod(a.shape) < 2**31 for a in arrays)


def check_int32_size(*arrays) -> None:
    for a in arrays:
        if not fits_int32_offsets(a):
            raise ValueError(f"array of shape {a.shape} has >= 2**31 elements; int32 offsets would overflow")


def reciprocal(divisor: jax.Array) -> jax.Array:
    """f32 1 / divisor. Rows are scaled by multiplying with it (`scale_rows`), as XLA's algebraic
    simplifier would rewrite x / divisor[:, None] anyway; the kernels that compare their values with
    the sampler's take it as an input, because Triton's own division rounds differently."""
    return jnp.float32(1) / divisor.astype(jnp.float32)


def scale_rows(x: jax.Array, divisor: jax.Array) -> jax.Array:
    """x [R, V] / divisor [R], computed as x * reciprocal(divisor)."""
    return x * reciprocal(divisor)[:, None]


class PenaltyArrays(NamedTuple):
    """The penalty inputs as plain arrays: per-slot tables and per-row parameters."""

    output_counts: jax.Array  # [N, V] any integer dtype
    prompt_mask: jax.Array  # u32[N, ceil(V / 32)]: token v is bit v % 32 of word v // 32
    rows: jax.Array  # i32[R]: table row of each batch row
    repetition: jax.Array  # f32[R]
    frequency: jax.Array  # f32[R]
    presence: jax.Array  # f32[R]


def penalize_values(logits, counts, in_prompt, repetition, frequency, presence):
    """Repetition, frequency and presence penalties on broadcastable operands (vLLM semantics).

    The counts are read through one f32 conversion that every term uses: with `counts > 0` and
    the frequency term each reading the gathered counts, XLA wrote the comparison out as a pass
    of its own."""
    c = counts.astype(jnp.float32)
    in_output = jnp.minimum(c, 1.0)  # 1.0 where the token was output
    penalized = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = jnp.where(in_prompt | (c > 0), penalized, logits)
    return logits - frequency * c - presence * in_output


def unpack_token_mask(words: jax.Array, vocab_size: int) -> jax.Array:
    """uint32[..., W] -> bool[..., V]. Pure shifts and a reshape: fuses into its consumer."""
    bits = (words[..., None] >> jnp.arange(WORD, dtype=jnp.uint32)) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :vocab_size].astype(bool)


def penalize_rows(logits: jax.Array, p: PenaltyArrays) -> jax.Array:
    """The penalties on logits f32[R, V], each row reading its table row `p.rows[r]`."""
    counts = p.output_counts[p.rows]
    in_prompt = unpack_token_mask(p.prompt_mask[p.rows], logits.shape[-1])
    return penalize_values(logits, counts, in_prompt, p.repetition[:, None], p.frequency[:, None],
                           p.presence[:, None])


def block_max_and_sumexp(x: jax.Array, divisor: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x f32[R, V] -> per block of BLOCK ids: (max, sum of exp((x - max) / divisor)), each
    f32[R, NB]; divisor f32[R] (None: 1)."""
    r, v = x.shape
    nb = num_blocks(v)
    blocks = jnp.pad(x, ((0, 0), (0, nb * BLOCK - v)), constant_values=-jnp.inf).reshape(r, nb, BLOCK)
    m = jnp.max(blocks, axis=-1)
    return m, sumexp_of_blocks(blocks, m, divisor)


def sumexp_of_blocks(blocks: jax.Array, block_max: jax.Array, divisor: jax.Array | None) -> jax.Array:
    """blocks [R, E, W], their maxima [R, E] -> sum of exp((x - max) / divisor) per block (0: all -inf)."""
    shifted = blocks - jnp.where(block_max == -jnp.inf, 0.0, block_max)[..., None]
    if divisor is not None:
        shifted = shifted / divisor[:, None, None]
    return jnp.sum(jnp.exp(shifted), axis=-1)


def row_tile(vocab_size: int, tile_blocks: int, tile=None):
    """Inside a kernel: tile `tile` of the row (default: this program's second grid index) as
    block indices [TB], mask words [TB, BLOCK / WORD], ids [TB, BLOCK / WORD, WORD] and which ids
    are in the row. Three axes, so that a mask word broadcasts over its 32 ids without a reshape."""
    tile = pl.program_id(1) if tile is None else tile
    blocks = tile * tile_blocks + jnp.arange(tile_blocks, dtype=jnp.int32)
    words = blocks[:, None] * (BLOCK // WORD) + jnp.arange(BLOCK // WORD, dtype=jnp.int32)[None, :]
    ids = words[:, :, None] * WORD + jnp.arange(WORD, dtype=jnp.int32)[None, None, :]
    return blocks, words, ids, ids < vocab_size
