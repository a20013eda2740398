"""The sampler's one pass over the logits as Pallas kernels (Triton backend), each next to a
pure-jnp reference of the same signature; mrv2_jax/sample/logit_stats.py adapts the engine's
types to them and says what each output is for.

Why the Triton backend: a streaming pass over each row with no matrix product, whose speed is the
rate of its loads. Mosaic GPU reaches global memory through TMA copies into shared memory, which
streamed one-row weights more slowly than plain wide loads into registers (docs/benchmarks.md,
sessions 50 and 51); a Mosaic GPU port of this pass is not measured.

``logit_stats``: grid (R, cdiv(NB, tile_blocks)); program (r, c) reads ids of blocks
[c * tile_blocks, (c + 1) * tile_blocks) of row r as one tile (or, with tiles_per_program > 1,
that many consecutive tiles in a loop): the raw
logits, and with penalties the row's output counts and prompt bit mask (table row
``rows[r]``: the gather is an address computation, no [R, V] copy). It writes the penalised
tile and, per block, the maximum and sum of exp((x - max) / divisor) of the penalised logits,
and the same (divisor 1) of the raw ones. The tile is [tile_blocks, 4, 32]: a prompt-mask word
covers 32 ids, and broadcasts over the last axis without a reshape.

``count_above``: grid (R, cdiv(NB, tile_blocks)); program (r, c) first reads its blocks'
maxima, and reads the logits of the tile only when one of them is above the row's threshold
(a block whose maximum is not above it holds nothing to count). Per-program counts go to an
[R, C] array summed outside.

Flattened 1-D refs and int32 offsets; tails (V not a multiple of the tile) are masked.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.sampler_common import (
    NEG_INF,
    WORD,
    PenaltyArrays,
    block_max_and_sumexp,
    check_int32_size,
    num_blocks,
    penalize_rows,
    penalize_values,
    row_tile,
)


class LogitStats(NamedTuple):
    processed: jax.Array  # f32[R, V]: after penalties (the raw logits when there are none)
    block_max: jax.Array  # f32[R, NB]: max of `processed` over ids [b * BLOCK, (b + 1) * BLOCK)
    block_sumexp: jax.Array  # f32[R, NB]: sum of exp((processed - block_max) / divisor)
    raw_block_max: jax.Array  # f32[R, NB]: the same for the raw logits
    raw_block_sumexp: jax.Array  # f32[R, NB]: sum of exp(raw - raw_block_max) (0: all -inf)


def logit_stats_reference(logits: jax.Array, divisor: jax.Array, penalties: PenaltyArrays | None = None,
                          ) -> LogitStats:
    """logits [R, V] (any float dtype); divisor f32[R] > 0 scales block_sumexp; penalties None:
    no penalty pass."""
    raw = logits.astype(jnp.float32)
    processed = raw if penalties is None else penalize_rows(raw, penalties)
    raw_max, raw_sumexp = block_max_and_sumexp(raw)
    block_max, block_sumexp = block_max_and_sumexp(processed, divisor)
    return LogitStats(processed, block_max, block_sumexp, raw_max, raw_sumexp)


def count_above_reference(logits: jax.Array, block_max: jax.Array, threshold: jax.Array) -> jax.Array:
    """i32[R]: the entries of each row of logits [R, V] greater than threshold f32[R] (block_max:
    the rows' block maxima, which only the kernel uses, to skip blocks)."""
    del block_max
    return jnp.sum(logits.astype(jnp.float32) > threshold[:, None], axis=-1, dtype=jnp.int32)


def _per_block(op, x):
    return op(op(x, axis=2), axis=1)


def _stats_kernel(*refs, vocab_size, tile_blocks, tiles_per_program, penalties):
    """Each program does `tiles_per_program` consecutive tiles of its row, in a loop (which
    Triton can software-pipeline with num_stages > 1)."""
    # Program ids are read once, outside the loop (the Pallas interpreter wants them there).
    r, first = pl.program_id(0), pl.program_id(1) * tiles_per_program
    if tiles_per_program == 1:
        return _stats_tile(*refs, vocab_size=vocab_size, tile_blocks=tile_blocks, penalties=penalties, r=r,
                           tile=first)

    def body(i, carry):
        _stats_tile(*refs, vocab_size=vocab_size, tile_blocks=tile_blocks, penalties=penalties, r=r, tile=first + i)
        return carry

    jax.lax.fori_loop(0, tiles_per_program, body, 0)


def _stats_tile(*refs, vocab_size, tile_blocks, penalties, r, tile):
    V, NB = vocab_size, num_blocks(vocab_size)
    if penalties:
        (logits_ref, divisor_ref, counts_ref, mask_ref, rows_ref, rep_ref, freq_ref, pres_ref,
         processed_ref, block_max_ref, block_sumexp_ref, raw_max_ref, raw_sumexp_ref) = refs
    else:
        logits_ref, divisor_ref, block_sumexp_ref, raw_max_ref, raw_sumexp_ref = refs
    blocks, words, ids, in_row = row_tile(V, tile_blocks, tile)
    block_ok = blocks < NB
    # Offsets stay affine in the lane index (no jnp.where on them): Triton then sees runs of
    # contiguous addresses and vectorises the accesses. Masked-off lanes past a row's end point
    # into the next row (or past the array's end) and are never dereferenced.
    at, block_at = r * V + ids, r * NB + blocks
    raw = pltriton.load(logits_ref.at[at], mask=in_row, other=0).astype(jnp.float32)
    raw = jnp.where(in_row, raw, NEG_INF)

    def store_stats(x, max_ref, sumexp_ref, divisor=None):
        block_max = _per_block(jnp.max, x)
        shifted = x - jnp.where(block_max == NEG_INF, 0.0, block_max)[:, None, None]
        if divisor is not None:
            shifted = shifted / divisor
        if max_ref is not None:
            pltriton.store(max_ref.at[block_at], block_max, mask=block_ok)
        pltriton.store(sumexp_ref.at[block_at], _per_block(jnp.sum, jnp.exp(shifted)), mask=block_ok)

    processed = raw
    if penalties:
        row = rows_ref[r]
        counts = pltriton.load(counts_ref.at[row * V + ids], mask=in_row, other=0)
        num_words = (V + WORD - 1) // WORD
        mask_words = pltriton.load(mask_ref.at[row * num_words + words], mask=words < num_words, other=0)
        bits = (mask_words[:, :, None] >> jnp.arange(WORD, dtype=jnp.uint32)[None, None, :]) & 1
        processed = penalize_values(raw, counts, bits == 1, rep_ref[r], freq_ref[r], pres_ref[r])
        processed = jnp.where(in_row, processed, NEG_INF)
        pltriton.store(processed_ref.at[at], processed, mask=in_row)
    store_stats(processed, block_max_ref if penalties else None, block_sumexp_ref, divisor_ref[r])
    store_stats(raw, raw_max_ref, raw_sumexp_ref)


@functools.partial(jax.jit, static_argnames=("interpret", "tile_blocks", "num_warps", "tiles_per_program",
                                             "num_stages"))
def logit_stats(logits: jax.Array, divisor: jax.Array, penalties: PenaltyArrays | None = None, *,
                interpret: bool = False, tile_blocks: int = 32, num_warps: int = 4, tiles_per_program: int = 1,
                num_stages: int = 1) -> LogitStats:
    """Same result as logit_stats_reference. The launch defaults are the fastest measured
    (docs/benchmarks.md); `bench logit_stats` sweeps them."""
    r, v = logits.shape
    nb = num_blocks(v)
    f32 = lambda n: jax.ShapeDtypeStruct((n,), jnp.float32)  # noqa: E731
    kernel = functools.partial(_stats_kernel, vocab_size=v, tile_blocks=tile_blocks,
                               tiles_per_program=tiles_per_program, penalties=penalties is not None)
    programs = pl.cdiv(pl.cdiv(nb, tile_blocks), tiles_per_program)
    call = functools.partial(
        pl.pallas_call, kernel, grid=(r, programs), interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages), name="logit_stats")
    blocks = lambda a: a.reshape(r, nb)  # noqa: E731
    divisor = divisor.astype(jnp.float32)
    if penalties is None:
        check_int32_size(logits)
        sumexp, raw_max, raw_sumexp = call(out_shape=(f32(r * nb),) * 3)(logits.reshape(-1), divisor)
        return LogitStats(logits.astype(jnp.float32), blocks(raw_max), blocks(sumexp), blocks(raw_max),
                          blocks(raw_sumexp))
    check_int32_size(logits, penalties.output_counts)
    f32_rows = lambda a: a.astype(jnp.float32)  # noqa: E731
    processed, *stats = call(out_shape=(f32(r * v),) + (f32(r * nb),) * 4)(
        logits.reshape(-1), divisor, penalties.output_counts.reshape(-1), penalties.prompt_mask.reshape(-1),
        penalties.rows.astype(jnp.int32), f32_rows(penalties.repetition), f32_rows(penalties.frequency),
        f32_rows(penalties.presence))
    return LogitStats(processed.reshape(r, v), *map(blocks, stats))


def _count_kernel(logits_ref, block_max_ref, threshold_ref, out_ref, *, vocab_size, tile_blocks):
    V, NB = vocab_size, num_blocks(vocab_size)
    r, c = pl.program_id(0), pl.program_id(1)
    blocks, _, ids, in_row = row_tile(V, tile_blocks)
    block_ok = blocks < NB
    maxima = pltriton.load(block_max_ref.at[r * NB + blocks], mask=block_ok, other=NEG_INF)
    threshold = threshold_ref[r]

    at = r * pl.num_programs(1) + c
    out_ref[at] = jnp.int32(0)

    @pl.when(jnp.max(jnp.where(block_ok, maxima, NEG_INF)) > threshold)
    def _count():
        x = pltriton.load(logits_ref.at[r * V + ids], mask=in_row, other=0)
        out_ref[at] = jnp.sum((x.astype(jnp.float32) > threshold) & in_row, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames=("interpret", "tile_blocks", "num_warps"))
def count_above(logits: jax.Array, block_max: jax.Array, threshold: jax.Array, *, interpret: bool = False,
                tile_blocks: int = 32, num_warps: int = 4) -> jax.Array:
    """Same result as count_above_reference -> i32[R]."""
    r, v = logits.shape
    check_int32_size(logits)
    programs = pl.cdiv(num_blocks(v), tile_blocks)
    partial = pl.pallas_call(
        functools.partial(_count_kernel, vocab_size=v, tile_blocks=tile_blocks),
        grid=(r, programs), out_shape=jax.ShapeDtypeStruct((r * programs,), jnp.int32),
        interpret=interpret, compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name="count_above",
    )(logits.reshape(-1), block_max.reshape(-1).astype(jnp.float32), threshold.astype(jnp.float32))
    return jnp.sum(partial.reshape(r, programs), axis=1, dtype=jnp.int32)
