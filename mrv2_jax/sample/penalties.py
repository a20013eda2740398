"""Repetition, presence and frequency penalties (vLLM semantics), fused in one elementwise pass.

    seen      = token in the prompt OR already in the output
    logit     = logit / rep   if seen and logit > 0
                logit * rep   if seen and logit <= 0
    logit    -= frequency * output_count + presence * (output_count > 0)

The repetition penalty looks at prompt and output; presence and frequency at the output only.

The data comes from the runner's persistent per-slot tables: output token counts `[N, V]`
(uint16 or int32, slot_state.py) and the prompt's token set as a bit mask
`uint32[N, ceil(V / 32)]` (32x smaller than a bool mask; token v is bit v % 32 of word v // 32).
`rows[R]` maps each batch row to its table row, and the gather is fused into the penalty pass, so
no [R, V] copy is made. The formula on arrays lives in pallas_kernels/sampler_common.py, which the
Pallas logit pass shares; this module adapts the engine's tables and SamplingTensors to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from mrv2_jax.sample.tensors import SamplingTensors
from pallas_kernels.sampler_common import (
    PenaltyArrays,
    num_mask_words,
    penalize_rows,
    penalize_values,
    unpack_token_mask,
)

__all__ = ["PenaltyData", "apply_penalties", "num_mask_words", "pack_token_mask", "penalize", "penalize_at",
           "penalty_arrays", "penalty_data_from_tokens", "unpack_token_mask"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PenaltyData:
    output_counts: jax.Array  # [N, V] any integer dtype (slot tables: u16 or i32)
    prompt_mask: jax.Array  # u32[N, ceil(V / 32)]
    rows: jax.Array  # i32[R]: table row of each batch row


def pack_token_mask(mask, xp=jnp):
    """bool[..., V] -> uint32[..., ceil(V / 32)] (numpy or jnp)."""
    v = mask.shape[-1]
    w = num_mask_words(v)
    pad = [(0, 0)] * (mask.ndim - 1) + [(0, w * 32 - v)]
    bits = xp.pad(mask, pad).reshape(*mask.shape[:-1], w, 32).astype(xp.uint32)
    return xp.sum(bits << xp.arange(32, dtype=xp.uint32), axis=-1, dtype=xp.uint32)


def penalize(logits, counts, in_prompt, t: SamplingTensors):
    """The penalty formula (pallas_kernels/sampler_common.py), elementwise; `logits`, `counts`,
    `in_prompt` are [R, N] (any N)."""
    return penalize_values(logits, counts, in_prompt, t.repetition_penalty[:, None],
                           t.frequency_penalty[:, None], t.presence_penalty[:, None])


def penalty_arrays(t: SamplingTensors, data: PenaltyData) -> PenaltyArrays:
    """The penalty tables and the rows' penalty parameters, as the kernels take them."""
    return PenaltyArrays(data.output_counts, data.prompt_mask, data.rows, t.repetition_penalty,
                         t.frequency_penalty, t.presence_penalty)


def apply_penalties(logits: jax.Array, t: SamplingTensors, data: PenaltyData) -> jax.Array:
    return penalize_rows(logits, penalty_arrays(t, data))


def penalize_at(values: jax.Array, t: SamplingTensors, data: PenaltyData, ids: jax.Array) -> jax.Array:
    """The penalty of `values` [R, N] as if they were the logits of token ids `ids` [R, N]."""
    rows = jnp.broadcast_to(data.rows[:, None], ids.shape)
    counts = data.output_counts.at[rows, ids].get(mode="fill", fill_value=0)
    words = data.prompt_mask.at[rows, ids >> 5].get(mode="fill", fill_value=0)
    in_prompt = (words >> (ids & 31).astype(jnp.uint32)) & 1 == 1
    return penalize(values, counts, in_prompt, t)


def penalty_data_from_tokens(prompts: list[list[int]], outputs: list[list[int]], vocab_size: int,
                             ) -> PenaltyData:
    """Host helper (tests, benchmarks): PenaltyData for explicit token lists, one row each."""
    n = len(prompts)
    counts = np.zeros((n, vocab_size), np.int32)
    mask = np.zeros((n, vocab_size), bool)
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        mask[i, prompt] = True
        np.add.at(counts[i], np.asarray(output, np.int64), 1)
    # device_put: jnp.asarray and jnp.arange would each compile a small program per shape.
    return PenaltyData(*jax.device_put((counts, pack_token_mask(mask, np), np.arange(n, dtype=np.int32))))
