"""The persistent batch state that lives on the device (Model Runner V2).

Every live request owns one *slot* (a row) of these fixed `[max_num_seqs, ...]` tables for its
whole life. The step function reads them to build its inputs and writes the sampled tokens back
into them, so nothing produced on the device goes through the host to become the next step's
input. The host only ever sends changes (new requests, prompt chunks, block-table appends).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mrv2_jax.sample.tensors import SCALAR_FIELDS, SamplingTensors


class DeviceState(NamedTuple):
    token_ids: jax.Array  # int32[S, max_model_len + 1]: prompt, then sampled tokens
    num_tokens: jax.Array  # int32[S]: tokens known on the device (prompt + sampled so far)
    prefill_len: jax.Array  # int32[S]: tokens the host provided (prompt + outputs before a resume)
    num_computed: jax.Array  # int32[S]: tokens whose KV has been computed
    block_table: jax.Array  # int32[S, max_blocks_per_seq]
    num_prompt: jax.Array  # int32[S]: the original prompt's length (outputs = num_tokens - num_prompt)
    sampler_row: jax.Array  # int32[S]: the slot if its sampler tables (penalties, bias) are this request's, else -1
    sampling: dict  # name -> [S]: the request's sampler scalars (temperature, top_k, seeds, ...)
    # int32[S, MAX_DEVICE_STOP_IDS]: token ids that end the request (EOS unless ignored, stop
    # token ids), -1 padding. Fused decode (runner/fused.py) stops a row on them on the device.
    stop_ids: jax.Array


# The sampler scalars kept per slot; `num_output_tokens` is not stored, it is derived each step.
SAMPLING_FIELDS = tuple(f for f in SCALAR_FIELDS if f != "num_output_tokens")
# Stop ids kept per slot. The host stays the authority on stops (it checks every token), so a
# request with more stop ids keeps only the first ones here: the device then merely runs past
# a stop it does not know, and the host drops those tokens, as it drops any overshoot.
MAX_DEVICE_STOP_IDS = 8


@functools.partial(jax.jit, static_argnames=("max_num_seqs", "max_model_len", "max_blocks_per_seq"))
def init_device_state(max_num_seqs: int, max_model_len: int, max_blocks_per_seq: int) -> DeviceState:
    """Every table in one compiled program (eager jnp.zeros would compile, or load, one program each)."""
    s = max_num_seqs
    zeros = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    neutral = SamplingTensors.neutral(s)
    return DeviceState(token_ids=zeros(s, max_model_len + 1), num_tokens=zeros(s), prefill_len=zeros(s),
                       num_computed=zeros(s), block_table=zeros(s, max_blocks_per_seq), num_prompt=zeros(s),
                       sampler_row=jnp.full((s,), -1, jnp.int32),
                       sampling={name: jnp.asarray(getattr(neutral, name)) for name in SAMPLING_FIELDS},
                       stop_ids=jnp.full((s, MAX_DEVICE_STOP_IDS), -1, jnp.int32))
