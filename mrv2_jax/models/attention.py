"""Attention backends the decoder layers call.

A backend is a callable `(q, k, v, layer, kv_cache, scale) -> (out, kv_cache)`. The model
code never knows whether it runs on the dense reference path or on the paged KV cache: the
backend object carries that step's metadata, and the decoder threads `kv_cache` through its
layer loop.
"""

import functools
from dataclasses import dataclass

import jax

from mrv2_jax.models.layers import dense_causal_attention


@dataclass(frozen=True)
class DenseAttention:
    """Attention over the tokens of this call only (no KV cache): the reference path, also
    used for training. Tokens attend within their segment, causally by position."""

    segment_ids: jax.Array  # int32[T]
    positions: jax.Array  # int32[T]

    def __call__(self, q, k, v, layer, kv_cache, scale):
        del layer
        return dense_causal_attention(q, k, v, self.segment_ids, self.positions, scale), kv_cache


@dataclass(frozen=True)
class PagedAttention:
    """Attention over the paged KV cache: write this step's K/V into their slots, then run
    ragged paged attention for the whole mixed prefill/decode batch. Metadata layout:
    docs/architecture.md. `use_kernels=False` selects the pure-jnp references (fast on CPU,
    where Pallas only runs in its slow interpreter)."""

    slot_mapping: jax.Array  # int32[T]
    block_tables: jax.Array  # int32[R, max_blocks_per_seq]
    seq_lens: jax.Array  # int32[R]
    query_start_loc: jax.Array  # int32[R + 1]
    num_seqs: jax.Array  # int32[]
    use_kernels: bool = True
    interpret: bool = False

    def __call__(self, q, k, v, layer, kv_cache, scale):
        from pallas_kernels import kv_write
        from pallas_kernels import ragged_paged_attention as rpa

        k_cache, v_cache = kv_cache
        if self.use_kernels:
            k_cache, v_cache = kv_write.write_kv(k_cache, v_cache, k, v, self.slot_mapping, layer,
                                                 interpret=self.interpret)
            attend = functools.partial(rpa.ragged_paged_attention, interpret=self.interpret)
        else:
            k_cache, v_cache = kv_write.write_kv_reference(k_cache, v_cache, k, v, self.slot_mapping, layer)
            attend = rpa.ragged_paged_attention_reference
        out = attend(q, k_cache, v_cache, layer, self.block_tables, self.seq_lens,
                     self.query_start_loc, self.num_seqs, sm_scale=scale)
        return out, (k_cache, v_cache)
