"""Per-slot sampler data that lives on the device: penalty counts, prompt masks, sparse lists.

Why on the device: penalties need, per request, output-token counts [V] and the prompt's token
set [V]. Sending a [R, V] matrix every step would be ~155 MB at 256 x 152K; instead the runner
keeps `[max_num_seqs, ...]` tables here, writes a request's rows once when it arrives (only if it
uses penalties, logit_bias or min_tokens) and bumps one count per sampled token inside the step
(an R-element scatter). The step gathers rows by slot (fused into the penalty pass). Logit-bias
and min_tokens stop lists are written once per request for the same reason: they would be
[R, 256 + 64] ints per step in the per-step buffer.

A slot's table rows are valid only for the request that wrote them: the runner passes, per batch
row, `table_row` = its slot if the request wrote its rows, else -1 (no bias, no stop ids; its
penalty values are neutral, so whatever counts the slot holds are ignored).

Memory: counts are uint16[S, V] when max_model_len <= 65,535 (a token occurs at most
max_model_len times in one sequence, so no count can wrap), else int32: 78 MB at S=256, V=152K
(311 MB at S=1024), half of int32. The penalty pass reads a batch's rows every step, so the
narrow table is also 78 MB less to read per 256-row step. The prompt mask is a bit mask, 32x
smaller than bytes.

The structured-output automaton pool (automata.py) rides along as `automata`: written by its own
small dispatch when a constrained request arrives, read by the steps that mask logits.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mrv2_jax.sample.automata import AutomatonTables, init_tables
from mrv2_jax.sample.penalties import PenaltyData, num_mask_words, pack_token_mask
from mrv2_jax.sample.tensors import SamplingRow, SamplingTensors

TOKEN_CHUNK = 1024  # token ids per write call (a long prompt takes several calls)


class SlotState(NamedTuple):
    output_counts: jax.Array  # u16 or i32 [S, V] (counts_dtype)
    prompt_mask: jax.Array  # u32[S, ceil(V / 32)]
    bias_ids: jax.Array  # i32[S, MB]
    bias_values: jax.Array  # f32[S, MB]
    stop_ids: jax.Array  # i32[S, MS]
    automata: AutomatonTables  # the structured-output automaton pool


def counts_dtype(max_model_len: int | None):
    """uint16 when no output count can pass 65,535 (at most max_model_len tokens per sequence),
    else (or when unknown) int32."""
    return jnp.uint16 if max_model_len is not None and max_model_len <= np.iinfo(np.uint16).max else jnp.int32


# One compiled program makes every table: each eager jnp.zeros / jnp.full would be a program of its
# own, compiled (or loaded from the compilation cache) at every engine start.
@functools.partial(jax.jit, static_argnames=("num_slots", "vocab_size", "max_bias", "max_stop", "max_model_len",
                                             "automaton_pool"))
def init_slot_state(num_slots: int, vocab_size: int, max_bias: int, max_stop: int,
                    max_model_len: int | None = None, automaton_pool: tuple[int, int] = (1, 1)) -> SlotState:
    """automaton_pool: (states, exception entries) of the structured-output pool."""
    return SlotState(jnp.zeros((num_slots, vocab_size), counts_dtype(max_model_len)),
                     jnp.zeros((num_slots, num_mask_words(vocab_size)), jnp.uint32),
                     jnp.full((num_slots, max_bias), -1, jnp.int32),
                     jnp.zeros((num_slots, max_bias), jnp.float32),
                     jnp.full((num_slots, max_stop), -1, jnp.int32),
                     init_tables(*automaton_pool, vocab_size))


def write_request(state: SlotState, slot, bias_ids, bias_values, stop_ids, token_ids, token_kind,
                  reset) -> SlotState:
    """One request's rows. token_kind[C]: 0 = prompt token, 1 = output token, -1 = padding;
    `reset` clears the slot's counts and mask first (the first chunk of a request)."""
    v = state.output_counts.shape[1]
    ids = jnp.where(token_kind >= 0, token_ids, v)  # padding goes out of range and is dropped
    outputs = jnp.zeros((v,), jnp.int32).at[ids].add((token_kind == 1).astype(jnp.int32), mode="drop")
    in_prompt = jnp.zeros((v,), jnp.int32).at[ids].add((token_kind == 0).astype(jnp.int32), mode="drop") > 0
    keep = jnp.logical_not(reset)
    counts = (jnp.where(keep, state.output_counts[slot], 0) + outputs).astype(state.output_counts.dtype)
    mask = jnp.where(keep, state.prompt_mask[slot], 0) | pack_token_mask(in_prompt)
    return state._replace(output_counts=state.output_counts.at[slot].set(counts),
                          prompt_mask=state.prompt_mask.at[slot].set(mask),
                          bias_ids=state.bias_ids.at[slot].set(bias_ids),
                          bias_values=state.bias_values.at[slot].set(bias_values),
                          stop_ids=state.stop_ids.at[slot].set(stop_ids))


def split(state: SlotState) -> tuple[jax.Array, tuple]:
    """-> (the counts a step updates, the tables it only reads). A step program takes the tables
    without donating them, so that its call neither returns nor replaces them: every array a call
    donates and returns costs the host more than one it only reads."""
    return state.output_counts, state[1:]


def join(counts: jax.Array, tables: tuple) -> SlotState:
    """The inverse of `split`."""
    return SlotState(counts, *tables)


def count_sampled(state: SlotState, table_rows: jax.Array, tokens: jax.Array) -> SlotState:
    """Inside the step: +1 for each sampled token of a row with table rows (-1: skipped)."""
    s = state.output_counts.shape[0]
    rows = jnp.where(table_rows >= 0, table_rows, s)
    return state._replace(output_counts=state.output_counts.at[rows, tokens].add(1, mode="drop"))


def batch_inputs(state: SlotState, t: SamplingTensors, table_rows: jax.Array):
    """Inside the step: `t` with its sparse lists read from the table -> (t, PenaltyData)."""
    valid = (table_rows >= 0)[:, None]
    rows = jnp.maximum(table_rows, 0)
    t = dataclasses.replace(t, bias_ids=jnp.where(valid, state.bias_ids[rows], -1),
                            bias_values=jnp.where(valid, state.bias_values[rows], 0.0),
                            stop_ids=jnp.where(valid, state.stop_ids[rows], -1))
    return t, PenaltyData(state.output_counts, state.prompt_mask, rows)


class SlotStateWriter:
    """Host side: writes a request's rows with one precompiled function (no compile later)."""

    def __init__(self, state: SlotState, chunk: int = TOKEN_CHUNK):
        self.chunk = chunk
        self.max_bias = state.bias_ids.shape[1]
        self.max_stop = state.stop_ids.shape[1]
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        self._write = jax.jit(write_request, donate_argnums=(0,)).lower(
            state, i32(), i32(self.max_bias), jax.ShapeDtypeStruct((self.max_bias,), jnp.float32),
            i32(self.max_stop), i32(chunk), i32(chunk), jax.ShapeDtypeStruct((), bool)).compile()

    def write(self, state: SlotState, slot: int, row: SamplingRow, token_ids, num_prompt_tokens: int,
              ) -> tuple[SlotState, bool]:
        """-> (new state, whether the slot's rows now belong to this request). Requests that use
        no penalty, bias or min_tokens list write nothing."""
        if not (row.uses_penalties or row.uses_sparse):
            return state, False
        bias_ids = np.full(self.max_bias, -1, np.int32)
        bias_values = np.zeros(self.max_bias, np.float32)
        stop_ids = np.full(self.max_stop, -1, np.int32)
        mb, ms = self.max_bias, self.max_stop  # longer lists were rejected up front
        bias_ids[: min(len(row.bias_ids), mb)] = row.bias_ids[:mb]
        bias_values[: min(len(row.bias_values), mb)] = row.bias_values[:mb]
        stop_ids[: min(len(row.stop_ids), ms)] = row.stop_ids[:ms]
        tokens = np.asarray(token_ids, np.int32) if row.uses_penalties else np.zeros(0, np.int32)
        kinds = (np.arange(len(tokens)) >= num_prompt_tokens).astype(np.int32)
        for start in range(0, max(len(tokens), 1), self.chunk):
            ids = np.zeros(self.chunk, np.int32)
            kind = np.full(self.chunk, -1, np.int32)
            piece = tokens[start : start + self.chunk]
            ids[: len(piece)] = piece
            kind[: len(piece)] = kinds[start : start + self.chunk]
            state = self._write(state, np.int32(slot), bias_ids, bias_values, stop_ids, ids, kind,
                                np.bool_(start == 0))
        return state, True
