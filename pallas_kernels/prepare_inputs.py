"""Model Runner V2 input preparation and post-update as Pallas kernels (Triton backend).

Drop-in replacements for the pure-jnp functions of ``mrv2_jax/runner/prepare.py`` (same
signatures, same results), modelled on vLLM MRV2's Triton kernels
(``_prepare_prefill_inputs_kernel``, ``_prepare_pos_seq_lens_kernel``,
``_compute_slot_mappings_kernel``, ``_gather_block_tables_kernel``, ``_post_update_kernel``).
The jnp versions stay the references; ``prepare_ops(use_kernels, interpret)`` returns
whichever set the runner should call.

Tables (``DeviceState``): request slot ``s`` owns row ``s`` of every table; its tokens live at
``token_ids[s, position]`` and its pages at ``block_table[s, position // block_size]``. Batch
row ``r`` is slot ``idx_mapping[r]``; rows ``>= num_reqs`` are padding. The tables are passed
to the kernels whole and flattened to 1-D (a free reshape), and every access is explicit
index arithmetic on them: Triton has no scalar prefetch, so nothing can be tiled by
BlockSpecs that depend on ``idx_mapping``.

``prepare_inputs``: one program per (batch row, split), grid ``(R + 1, num_splits)``.
  * ``query_start_loc`` is an R-long scan, computed with ``jnp.cumsum`` before the kernel;
    program ``r`` then owns tokens ``[qsl[r], qsl[r+1])`` and, like vLLM's
    ``_prepare_pos_seq_lens_kernel``, the extra program ``r == R`` owns the padding tokens
    ``[qsl[num_reqs], T)`` and writes input id 0, position 0, slot -1 there. Every element of
    every output is therefore written by exactly one program, and nothing is pre-zeroed.
  * A row's tokens are visited in power-of-two tiles of ``block_t`` (masked at the row's
    end) by a ``fori_loop`` with a dynamic trip count. A long prefill chunk would serialise
    many tiles in one program, so a row's tiles are dealt round-robin to ``num_splits``
    programs (grid axis 1); for rows with fewer tiles the extra programs exit at once.
  * Per token: ``position = num_computed[slot] + j``; for prompt positions (``position <
    prefill_len[slot]``) the chunk token is stored into the token table and is also the
    input id; other positions read their input id from the table (a token sampled by an
    earlier step). This equals "write the chunk, then read the table" (prepare.py) without a
    read-after-write through global memory: within a step, the positions written and the
    positions read are disjoint, and each slot belongs to one row. ``slot_mapping = block *
    block_size + position % block_size`` with the block gathered from the block table.
  * Per row (program ``(r, 0)``): ``seq_lens``, ``samples`` (as int32; bool on the way out)
    and ``logits_indices``.
  * The token table is updated in place: ``input_output_aliases`` makes the output the
    input buffer, so with the caller donating the state (the jitted step donates it)
    nothing is copied.

``gather_block_tables``: grid ``(R, cdiv(max_blocks, block_b))``; program ``(r, c)`` copies
columns ``[c*block_b, (c+1)*block_b)`` of ``block_table[idx_mapping[r]]``. Padding rows copy
whatever slot ``idx_mapping`` names, exactly as ``block_table[idx_mapping]`` does.

``post_update``: one program per batch row, scalar loads and masked scalar stores, aliased
in place like above: ``num_computed[slot] = seq_lens[r]`` for real rows, and for sampling
rows ``token_ids[slot, seq_lens[r]] = sampled[r]``, ``num_tokens[slot] = seq_lens[r] + 1``.

Slot and table indices follow jnp's semantics, so the kernels match the references even for
odd inputs (a padding row's ``idx_mapping`` entry, say): a slot index ``s < 0`` means
``s + S``; gathers clamp out-of-range indices, scatters drop them. Masked-off lanes of a
store get an index one past the end of the array: the GPU never dereferences it, and the
interpret-mode emulation of a masked store (a scatter that writes the old value back under
the mask) drops it, so it cannot overwrite a real write.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mrv2_jax.runner import prepare as reference
from mrv2_jax.runner.device_state import DeviceState
from mrv2_jax.runner.prepare import StepInputs

__all__ = ["prepare_inputs", "gather_block_tables", "post_update", "prepare_ops", "PrepareOps",
           "default_tuning"]


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _wrap_slot(slot, num_slots: int):
    """jnp's reading of a slot index: negative counts from the end."""
    return jnp.where(slot < 0, slot + num_slots, slot)


def _check_table_size(*tables):
    """The kernels address the flattened tables with int32 offsets."""
    for table in tables:
        shape = getattr(table, "shape", table)
        if math.prod(shape) >= 2**31:
            raise ValueError(f"table of shape {shape} has >= 2**31 elements; "
                             "int32 offsets would overflow")


def default_tuning(num_tokens: int, num_rows: int) -> dict:
    """Static launch parameters for a bucket of T tokens and R rows.

    Decode-shaped buckets (T <= R: about one token per row) get small tiles and no split,
    since every row fits one tile. Prefill/mixed buckets get 256-token tiles and enough
    splits that even a row holding all T tokens needs at most ~4 tiles per program.
    """
    if num_tokens <= num_rows:
        return dict(block_t=16, num_splits=1, num_warps=1)
    block_t = 256
    num_splits = min(8, _next_pow2(pl.cdiv(num_tokens, 4 * block_t)))
    return dict(block_t=block_t, num_splits=num_splits, num_warps=4)


# ----------------------------------------------------------------------------------------
# prepare_inputs
# ----------------------------------------------------------------------------------------

def _prepare_kernel(num_reqs_ref, idx_mapping_ref, qsl_ref, chunk_ref, num_computed_ref,
                    prefill_len_ref, num_tokens_ref, block_table_ref, token_ids_in_ref,
                    token_ids_ref, input_ids_ref, positions_ref, slot_mapping_ref,
                    seq_lens_ref, samples_ref, logits_indices_ref, *, num_tokens, num_rows,
                    num_slots, max_blocks, width, block_size, block_t, num_splits):
    del token_ids_in_ref  # aliased to token_ids_ref; all access goes through the output
    T, R, S = num_tokens, num_rows, num_slots
    r, split = pl.program_id(0), pl.program_id(1)
    num_reqs = jnp.clip(num_reqs_ref[0], 0, R)
    is_pad_program = r == R  # the pseudo-row that owns the padding tokens
    real = r < num_reqs
    rc = jnp.minimum(r, R - 1)  # keeps the pseudo-row's scalar reads in bounds

    # The program's token range [q0, q1).
    total = qsl_ref[num_reqs]
    q0 = jnp.where(is_pad_program, total, qsl_ref[rc])
    q1 = jnp.where(is_pad_program, T, qsl_ref[rc + 1])
    n = jnp.maximum(q1 - q0, 0)
    slot = jnp.clip(_wrap_slot(idx_mapping_ref[rc], S), 0, S - 1)
    # Only real rows own real tokens; the pseudo-row and padded rows read nothing.
    start = jnp.where(real, num_computed_ref[slot], 0)
    prefill_len = jnp.where(real, prefill_len_ref[slot], 0)

    # --- Per-row outputs, written once (split 0) by each of the R row programs.
    seq_len = jnp.where(real, start + n, 0)
    samples = real & (n > 0) & (seq_len >= num_tokens_ref[slot])
    row_out = jnp.where((split == 0) & ~is_pad_program, r, R)  # R: one past the end
    row_mask = row_out < R
    pltriton.store(seq_lens_ref.at[row_out], seq_len, mask=row_mask)
    pltriton.store(samples_ref.at[row_out], samples.astype(jnp.int32), mask=row_mask)
    pltriton.store(logits_indices_ref.at[row_out], jnp.maximum(q1 - 1, 0), mask=row_mask)

    # --- Per-token outputs: this program's tiles are split, split + num_splits, ...
    num_tiles = lax.div(n + block_t - 1, block_t)
    my_tiles = lax.div(jnp.maximum(num_tiles - split, 0) + num_splits - 1, num_splits)
    lane = jnp.arange(block_t, dtype=jnp.int32)

    def tile(i, carry):
        j = (split + i * num_splits) * block_t + lane  # token index within the row
        t = q0 + j
        in_row = (j < n) & (t < T)
        tok = in_row & real  # a real token (padding tokens only get the fill values)
        pos = jnp.where(tok, start + j, 0)

        is_prompt = tok & (pos < prefill_len) & (pos < width)
        chunk = pltriton.load(chunk_ref.at[jnp.where(in_row, t, 0)], mask=is_prompt, other=0)
        # Reads clamp like jnp's gathers; a write past the row is dropped like jnp's scatter.
        table_at = slot * width + jnp.minimum(pos, width - 1)
        pltriton.store(token_ids_ref.at[jnp.where(is_prompt, table_at, S * width)], chunk,
                       mask=is_prompt)
        # Non-prompt positions hold tokens sampled by earlier steps (never written here).
        from_table = pltriton.load(token_ids_ref.at[table_at], mask=tok & ~is_prompt, other=0)
        input_ids = jnp.where(is_prompt, chunk, from_table)

        page = jnp.minimum(lax.div(pos, block_size), max_blocks - 1)
        block = pltriton.load(block_table_ref.at[slot * max_blocks + page], mask=tok, other=0)
        slot_mapping = jnp.where(tok, block * block_size + lax.rem(pos, block_size), -1)

        out_at = jnp.where(in_row, t, T)
        pltriton.store(input_ids_ref.at[out_at], input_ids, mask=in_row)
        pltriton.store(positions_ref.at[out_at], pos, mask=in_row)
        pltriton.store(slot_mapping_ref.at[out_at], slot_mapping, mask=in_row)
        return carry

    lax.fori_loop(0, my_tiles, tile, jnp.int32(0))


def prepare_inputs(state: DeviceState, idx_mapping, num_scheduled, num_reqs, chunk_tokens,
                   block_size: int, *, interpret: bool = False, block_t: int | None = None,
                   num_splits: int | None = None, num_warps: int | None = None,
                   num_stages: int = 1) -> tuple[DeviceState, StepInputs]:
    """Kernel version of ``prepare.prepare_inputs`` (same arguments and results).

    Extra keyword arguments: ``interpret`` runs the Pallas interpreter (CPU tests);
    ``block_t`` (tokens per tile, a power of two), ``num_splits`` (programs per row) and
    ``num_warps``/``num_stages`` tune the launch; left as None they take
    ``default_tuning``'s values for the bucket.
    """
    T, R = chunk_tokens.shape[0], idx_mapping.shape[0]
    S, width = state.token_ids.shape
    max_blocks = state.block_table.shape[1]
    _check_table_size(state.token_ids, state.block_table)
    cfg = default_tuning(T, R)
    given = dict(block_t=block_t, num_splits=num_splits, num_warps=num_warps)
    cfg.update({k: v for k, v in given.items() if v is not None})
    if not (_is_pow2(cfg["block_t"]) and cfg["num_splits"] >= 1):
        raise ValueError(f"block_t={cfg['block_t']} must be a power of two, "
                         f"num_splits={cfg['num_splits']} >= 1")

    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    num_reqs = i32(num_reqs)
    counts = jnp.where(jnp.arange(R) < num_reqs, i32(num_scheduled), 0)
    query_start_loc = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])

    kernel = functools.partial(
        _prepare_kernel, num_tokens=T, num_rows=R, num_slots=S, max_blocks=max_blocks,
        width=width, block_size=block_size, block_t=cfg["block_t"],
        num_splits=cfg["num_splits"])
    vec = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)  # noqa: E731
    token_ids, input_ids, positions, slot_mapping, seq_lens, samples, logits_indices = pl.pallas_call(
        kernel,
        grid=(R + 1, cfg["num_splits"]),
        out_shape=(vec(S * width), vec(T), vec(T), vec(T), vec(R), vec(R), vec(R)),
        # Inputs: num_reqs, idx_mapping, qsl, chunk, num_computed, prefill_len, num_tokens,
        # block_table, token_ids (8) -> output 0.
        input_output_aliases={8: 0},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"], num_stages=num_stages),
        name="prepare_inputs",
    )(
        num_reqs.reshape(1), i32(idx_mapping), query_start_loc, i32(chunk_tokens),
        state.num_computed, state.prefill_len, state.num_tokens, state.block_table.reshape(-1),
        state.token_ids.reshape(-1),
    )
    inputs = StepInputs(
        input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
        query_start_loc=query_start_loc, seq_lens=seq_lens, logits_indices=logits_indices,
        block_tables=gather_block_tables(state.block_table, idx_mapping, interpret=interpret),
        samples=samples != 0)
    return state._replace(token_ids=token_ids.reshape(S, width)), inputs


# ----------------------------------------------------------------------------------------
# gather_block_tables
# ----------------------------------------------------------------------------------------

def _gather_kernel(idx_mapping_ref, block_table_ref, out_ref, *, num_rows, num_slots,
                   max_blocks, block_b):
    r, c = pl.program_id(0), pl.program_id(1)
    slot = jnp.clip(_wrap_slot(idx_mapping_ref[r], num_slots), 0, num_slots - 1)
    col = c * block_b + jnp.arange(block_b, dtype=jnp.int32)
    ok = col < max_blocks
    col = jnp.minimum(col, max_blocks - 1)
    blocks = pltriton.load(block_table_ref.at[slot * max_blocks + col], mask=ok, other=0)
    pltriton.store(out_ref.at[jnp.where(ok, r * max_blocks + col, num_rows * max_blocks)],
                   blocks, mask=ok)


def gather_block_tables(block_table, idx_mapping, *, interpret: bool = False,
                        block_b: int | None = None, num_warps: int = 4):
    """``block_table[idx_mapping]``: the batch's rows of the block table, in batch order."""
    S, max_blocks = block_table.shape
    R = idx_mapping.shape[0]
    _check_table_size(block_table, (R, max_blocks))
    block_b = block_b or min(1024, _next_pow2(max_blocks))
    if not _is_pow2(block_b):
        raise ValueError(f"block_b={block_b} must be a power of two")
    kernel = functools.partial(_gather_kernel, num_rows=R, num_slots=S, max_blocks=max_blocks,
                               block_b=block_b)
    out = pl.pallas_call(
        kernel,
        grid=(R, pl.cdiv(max_blocks, block_b)),
        out_shape=jax.ShapeDtypeStruct((R * max_blocks,), block_table.dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name="gather_block_tables",
    )(jnp.asarray(idx_mapping, jnp.int32), block_table.reshape(-1))
    return out.reshape(R, max_blocks)


# ----------------------------------------------------------------------------------------
# post_update
# ----------------------------------------------------------------------------------------

def _post_update_kernel(num_reqs_ref, idx_mapping_ref, seq_lens_ref, samples_ref, sampled_ref,
                        num_computed_in_ref, num_tokens_in_ref, token_ids_in_ref,
                        num_computed_ref, num_tokens_ref, token_ids_ref, *, num_slots, width):
    del num_computed_in_ref, num_tokens_in_ref, token_ids_in_ref  # aliased to the outputs
    S = num_slots
    r = pl.program_id(0)
    slot = _wrap_slot(idx_mapping_ref[r], S)
    slot_ok = (slot >= 0) & (slot < S)  # scatters drop out-of-range slots, like jnp's
    seq_len = seq_lens_ref[r]

    advance = slot_ok & (r < num_reqs_ref[0])
    pltriton.store(num_computed_ref.at[jnp.where(advance, slot, S)], seq_len, mask=advance)

    append = slot_ok & (samples_ref[r] != 0)
    pltriton.store(num_tokens_ref.at[jnp.where(append, slot, S)], seq_len + 1, mask=append)
    write = append & (seq_len >= 0) & (seq_len < width)
    at = jnp.where(write, slot * width + seq_len, S * width)
    pltriton.store(token_ids_ref.at[at], sampled_ref[r], mask=write)


def post_update(state: DeviceState, idx_mapping, num_reqs, inputs: StepInputs, sampled, *,
                interpret: bool = False, num_warps: int = 1) -> DeviceState:
    """Kernel version of ``prepare.post_update``: advance num_computed, append sampled tokens."""
    S, width = state.token_ids.shape
    R = idx_mapping.shape[0]
    _check_table_size(state.token_ids)
    kernel = functools.partial(_post_update_kernel, num_slots=S, width=width)
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    num_computed, num_tokens, token_ids = pl.pallas_call(
        kernel,
        grid=(R,),
        out_shape=(jax.ShapeDtypeStruct((S,), jnp.int32), jax.ShapeDtypeStruct((S,), jnp.int32),
                   jax.ShapeDtypeStruct((S * width,), jnp.int32)),
        # Inputs: num_reqs, idx_mapping, seq_lens, samples, sampled, num_computed (5),
        # num_tokens (6), token_ids (7).
        input_output_aliases={5: 0, 6: 1, 7: 2},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name="post_update",
    )(
        i32(num_reqs).reshape(1), i32(idx_mapping), i32(inputs.seq_lens),
        i32(inputs.samples), i32(sampled), state.num_computed, state.num_tokens,
        state.token_ids.reshape(-1),
    )
    return state._replace(num_computed=num_computed, num_tokens=num_tokens,
                          token_ids=token_ids.reshape(S, width))


# ----------------------------------------------------------------------------------------
# Selection
# ----------------------------------------------------------------------------------------

class PrepareOps(NamedTuple):
    """The device-side preparation functions the V2 step calls (prepare.py's signatures)."""
    apply_new_requests: Callable
    apply_block_writes: Callable
    prepare_inputs: Callable
    post_update: Callable


def prepare_ops(use_kernels: bool, interpret: bool = False) -> PrepareOps:
    """The jnp references (``use_kernels=False``) or the Pallas kernels.

    New requests and block appends are a few tiny scatters that XLA fuses well; they stay
    jnp either way.
    """
    if not use_kernels:
        return PrepareOps(reference.apply_new_requests, reference.apply_block_writes,
                          reference.prepare_inputs, reference.post_update)
    return PrepareOps(reference.apply_new_requests, reference.apply_block_writes,
                      functools.partial(prepare_inputs, interpret=interpret),
                      functools.partial(post_update, interpret=interpret))
