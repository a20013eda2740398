"""Input preparation and post-update on the device (Model Runner V2), as pure jnp functions.

These run inside the jitted step, after the host's small packed update has been applied:
  apply_new_requests / apply_block_writes  host changes -> persistent tables
  prepare_inputs                           tables + (idx_mapping, num_scheduled) -> model inputs
  post_update                              sampled tokens -> tables (for the next step to read)
Row r of the batch is request slot `idx_mapping[r]`; rows >= num_reqs are padding.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mrv2_jax.runner.device_state import SAMPLING_FIELDS, DeviceState
from mrv2_jax.sample import automata
from mrv2_jax.sample.tensors import SamplingTensors


class StepInputs(NamedTuple):
    input_ids: jax.Array  # int32[T]
    positions: jax.Array  # int32[T]
    slot_mapping: jax.Array  # int32[T], -1 for padding tokens
    query_start_loc: jax.Array  # int32[R + 1]
    seq_lens: jax.Array  # int32[R], 0 for padded rows
    logits_indices: jax.Array  # int32[R]
    block_tables: jax.Array  # int32[R, max_blocks_per_seq], batch order
    samples: jax.Array  # bool[R]: the row's computed tokens reach its end, so it samples


def apply_new_requests(state: DeviceState, slot, prefill_len, num_computed, num_prompt=None,
                       sampler_row=None, sampling: dict | None = None, stop_ids=None) -> DeviceState:
    """Initialise the rows of newly added (or resumed) requests; `slot == -1` entries are unused.
    Fields not given keep their defaults for those rows (prompt = prefill, no sampler tables,
    neutral = greedy sampling, no stop ids)."""
    s = state.token_ids.shape[0]
    idx = jnp.where(slot >= 0, slot, s)  # out of bounds -> dropped
    scalars = state.scalars.put_rows(idx, {
        **(sampling or {}), "num_tokens": prefill_len, "prefill_len": prefill_len, "num_computed": num_computed,
        "num_prompt": prefill_len if num_prompt is None else num_prompt,
        "sampler_row": -1 if sampler_row is None else sampler_row})
    stop_ids = state.stop_ids.at[idx].set(-1 if stop_ids is None else stop_ids, mode="drop")
    return state._replace(scalars=scalars, stop_ids=stop_ids)


# The token a step returns for a row whose table entries contradict its schedule (diverged_rows).
DIVERGED = -2


def diverged_rows(state: DeviceState, idx_mapping, num_scheduled, num_reqs) -> jax.Array:
    """bool[R]: scheduled rows past their prefill whose token count is not one past their computed
    tokens, as every decoding row's must be. Such a row's tables no longer say what the host
    scheduled (a wrongly compiled step program dropped an update once): the step returns
    DIVERGED for it and the host stops with an error instead of decoding from wrong inputs."""
    scheduled = (jnp.arange(idx_mapping.shape[0]) < num_reqs) & (num_scheduled > 0)
    computed, known = state.num_computed[idx_mapping], state.num_tokens[idx_mapping]
    decoding = computed >= state.prefill_len[idx_mapping]
    return scheduled & decoding & (known != computed + 1)


def batch_sampling(state: DeviceState, idx_mapping, num_reqs) -> tuple[SamplingTensors, jax.Array]:
    """The sampler rows of this step's batch, read from the slot tables (padding rows neutral),
    and each row's sampler-table row (-1: none). Read before `post_update`."""
    num_rows = idx_mapping.shape[0]
    real_row = jnp.arange(num_rows) < num_reqs
    neutral = SamplingTensors.neutral(num_rows)
    rows = state.scalars.rows(idx_mapping)
    scalars = {name: jnp.where(real_row, rows[name], getattr(neutral, name)) for name in SAMPLING_FIELDS}
    scalars["num_output_tokens"] = jnp.where(real_row, rows["num_tokens"] - rows["num_prompt"], 0)
    tensors = SamplingTensors(**scalars, bias_ids=None, bias_values=None, stop_ids=None)
    return tensors, jnp.where(real_row, rows["sampler_row"], -1)


def apply_block_writes(state: DeviceState, slot, index, block_id) -> DeviceState:
    """block_table[slot, index] = block_id for every entry with slot >= 0."""
    s = state.block_table.shape[0]
    rows = jnp.where(slot >= 0, slot, s)
    return state._replace(block_table=state.block_table.at[rows, index].set(block_id, mode="drop"))


def prepare_inputs(state: DeviceState, idx_mapping, num_scheduled, num_reqs, chunk_tokens,
                   block_size: int) -> tuple[DeviceState, StepInputs]:
    """Build the step's model inputs from the persistent tables.

    `chunk_tokens[t]` carries, for tokens of prefill chunks, the prompt token at that position
    (the host sends prompt tokens only when they are scheduled); it is written into the token
    table first, so every row's input ids are then read from the table alike: prompt tokens and
    the tokens sampled by earlier steps.
    """
    num_tokens_padded = chunk_tokens.shape[0]
    num_rows = idx_mapping.shape[0]
    real_row = jnp.arange(num_rows) < num_reqs
    counts = jnp.where(real_row, num_scheduled, 0)
    query_start_loc = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    total = query_start_loc[-1]
    start = state.num_computed[idx_mapping]  # first position computed this step, per row

    t = jnp.arange(num_tokens_padded, dtype=jnp.int32)
    # Unrolled: a while loop in a step makes XLA re-record its CUDA graphs on every call.
    row = jnp.clip(jnp.searchsorted(query_start_loc, t, side="right", method="scan_unrolled") - 1, 0, num_rows - 1)
    valid = t < total
    slot = idx_mapping[row]
    positions = jnp.where(valid, start[row] + t - query_start_loc[row], 0)

    is_prompt = valid & (positions < state.prefill_len[slot])
    s = state.token_ids.shape[0]
    token_ids = state.token_ids.at[jnp.where(is_prompt, slot, s), positions].set(chunk_tokens, mode="drop")
    input_ids = jnp.where(valid, token_ids[slot, positions], 0)

    block = state.block_table[slot, positions // block_size]
    slot_mapping = jnp.where(valid, block * block_size + positions % block_size, -1)
    seq_lens = jnp.where(real_row, start + counts, 0)
    samples = real_row & (counts > 0) & (seq_lens >= state.num_tokens[idx_mapping])
    inputs = StepInputs(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                        query_start_loc=query_start_loc, seq_lens=seq_lens,
                        logits_indices=jnp.maximum(query_start_loc[1:] - 1, 0),
                        block_tables=state.block_table[idx_mapping], samples=samples)
    return state._replace(token_ids=token_ids), inputs


def post_update(state: DeviceState, idx_mapping, num_reqs, inputs: StepInputs, sampled) -> DeviceState:
    """Advance num_computed and append each sampling row's token to its slot's token table."""
    s = state.token_ids.shape[0]
    real_row = jnp.arange(idx_mapping.shape[0]) < num_reqs
    rows = jnp.where(real_row, idx_mapping, s)
    sample_rows = jnp.where(inputs.samples, idx_mapping, s)
    token_ids = state.token_ids.at[sample_rows, inputs.seq_lens].set(sampled, mode="drop")
    scalars = (state.scalars.set_at("num_computed", rows, inputs.seq_lens)
               .set_at("num_tokens", sample_rows, inputs.seq_lens + 1))
    return state._replace(token_ids=token_ids, scalars=scalars)


def advance_automata(state: DeviceState, idx_mapping, inputs: StepInputs, tables, states, sampled) -> DeviceState:
    """Structured outputs: each sampling row's automaton state after its sampled token (rows
    without a constraint keep -1); `states` i32[R] as the step read them (batch_sampling)."""
    s = state.token_ids.shape[0]
    rows = jnp.where(inputs.samples & (states >= 0), idx_mapping, s)
    advanced = automata.advance(tables, states, sampled)
    return state._replace(scalars=state.scalars.set_at("automaton_state", rows, advanced))
