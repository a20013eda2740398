"""The persistent batch state that lives on the device (Model Runner V2).

Every live request owns one *slot* (a row) of these fixed `[max_num_seqs, ...]` tables for its
whole life. The step function reads them to build its inputs and writes the sampled tokens back
into them, so nothing produced on the device goes through the host to become the next step's
input. The host only ever sends changes (new requests, prompt chunks, block-table appends).

A slot's scalars (its token counts and its sampler settings) sit as columns of two tables, one
int32 and one float32, rather than one array each: every array a step program donates and returns
costs the host a few microseconds per call (docs/benchmarks.md, "What one carried array costs"),
and on the device one row gather reads all of a batch's scalars.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mrv2_jax.sample.tensors import FLOAT_SCALAR_FIELDS, SCALAR_FIELDS, SamplingTensors

# The sampler scalars kept per slot; `num_output_tokens` is not stored, it is derived each step.
SAMPLING_FIELDS = tuple(f for f in SCALAR_FIELDS if f != "num_output_tokens")
# Stop ids kept per slot. The host stays the authority on stops (it checks every token), so a
# request with more stop ids keeps only the first ones here: the device then merely runs past
# a stop it does not know, and the host drops those tokens, as it drops any overshoot.
MAX_DEVICE_STOP_IDS = 8

# A slot's token counts: known tokens (prompt + sampled so far), tokens the host provided (prompt +
# outputs before a resume), tokens whose KV is computed, the original prompt's length (outputs =
# num_tokens - num_prompt), and its sampler-table row (the slot if its penalty/bias tables are this
# request's, else -1).
COUNT_FIELDS = ("num_tokens", "prefill_len", "num_computed", "num_prompt", "sampler_row")
INT_COLUMNS = COUNT_FIELDS + tuple(f for f in SAMPLING_FIELDS if f not in FLOAT_SCALAR_FIELDS)
FLOAT_COLUMNS = tuple(f for f in SAMPLING_FIELDS if f in FLOAT_SCALAR_FIELDS)
_COLUMN = {**{name: ("ints", j) for j, name in enumerate(INT_COLUMNS)},
           **{name: ("floats", j) for j, name in enumerate(FLOAT_COLUMNS)}}
# What a freed or new slot holds in a column nobody set: greedy sampling, no sampler tables, no counts.
_NEUTRAL = {**{name: float(np.asarray(getattr(SamplingTensors.neutral(1), name))[0]) for name in SAMPLING_FIELDS},
            **dict.fromkeys(COUNT_FIELDS, 0), "sampler_row": -1}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SlotScalars:
    """Per-slot scalars by name: `ints` int32[S, len(INT_COLUMNS)], `floats` float32[S, len(FLOAT_COLUMNS)]."""
    ints: jax.Array
    floats: jax.Array

    @classmethod
    def neutral(cls, num_slots: int) -> SlotScalars:
        column = lambda name, dtype: jnp.full((num_slots,), _NEUTRAL[name], dtype)  # noqa: E731
        return cls(jnp.stack([column(n, jnp.int32) for n in INT_COLUMNS], axis=1),
                   jnp.stack([column(n, jnp.float32) for n in FLOAT_COLUMNS], axis=1))

    def __getitem__(self, name: str) -> jax.Array:
        table, j = _COLUMN[name]
        return getattr(self, table)[:, j]

    def rows(self, index) -> SlotScalars:
        """The scalars of slots `index` (one gather per table)."""
        return SlotScalars(self.ints[index], self.floats[index])

    def set_at(self, name: str, slots, values) -> SlotScalars:
        """Column `name` of slots `slots` set to `values`; out-of-range slots are dropped."""
        table, j = _COLUMN[name]
        updated = getattr(self, table).at[slots, j].set(values, mode="drop")
        return SlotScalars(updated, self.floats) if table == "ints" else SlotScalars(self.ints, updated)

    def put_rows(self, slots, values: dict) -> SlotScalars:
        """Whole rows of slots `slots` (out-of-range ones dropped): each column from `values`
        (an array over `slots` or a scalar), or neutral where `values` does not name it."""
        n = slots.shape[0]

        def block(names, dtype):
            return jnp.stack([jnp.broadcast_to(jnp.asarray(values.get(name, _NEUTRAL[name]), dtype), (n,))
                              for name in names], axis=1)

        return SlotScalars(self.ints.at[slots].set(block(INT_COLUMNS, jnp.int32), mode="drop"),
                           self.floats.at[slots].set(block(FLOAT_COLUMNS, jnp.float32), mode="drop"))


class DeviceState(NamedTuple):
    token_ids: jax.Array  # int32[S, max_model_len + 1]: prompt, then sampled tokens
    block_table: jax.Array  # int32[S, max_blocks_per_seq]
    # int32[S, MAX_DEVICE_STOP_IDS]: token ids that end the request (EOS unless ignored, stop
    # token ids), -1 padding. Fused decode (runner/fused.py) stops a row on them on the device.
    stop_ids: jax.Array
    scalars: SlotScalars  # COUNT_FIELDS and SAMPLING_FIELDS, one column each

    # The count columns by name, read only (write them through `scalars`).
    num_tokens = property(lambda self: self.scalars["num_tokens"])
    prefill_len = property(lambda self: self.scalars["prefill_len"])
    num_computed = property(lambda self: self.scalars["num_computed"])
    num_prompt = property(lambda self: self.scalars["num_prompt"])
    sampler_row = property(lambda self: self.scalars["sampler_row"])


@functools.partial(jax.jit, static_argnames=("max_num_seqs", "max_model_len", "max_blocks_per_seq"))
def init_device_state(max_num_seqs: int, max_model_len: int, max_blocks_per_seq: int) -> DeviceState:
    """Every table in one compiled program (eager jnp.zeros would compile, or load, one program each)."""
    s = max_num_seqs
    return DeviceState(token_ids=jnp.zeros((s, max_model_len + 1), jnp.int32),
                       block_table=jnp.zeros((s, max_blocks_per_seq), jnp.int32),
                       stop_ids=jnp.full((s, MAX_DEVICE_STOP_IDS), -1, jnp.int32),
                       scalars=SlotScalars.neutral(s))
