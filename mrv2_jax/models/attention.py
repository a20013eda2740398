"""Attention backends the decoder layers call.

A backend is a callable `(q, k, v, layer, kv_cache, scale) -> (out, kv_cache)`. The model
code never knows whether it runs on the dense reference path or on the paged KV cache: the
backend object carries that step's metadata, and the decoder threads `kv_cache` through its
layer loop.
"""

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
