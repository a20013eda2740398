"""The anchor beside the paged kernels of benchmarks/attention_kernel.py: JAX's own Mosaic GPU flash
attention (``jax.experimental.pallas.ops.gpu.attention_mgpu``: two compute warpgroups of 64 query rows
and one TMA warpgroup per CTA, FlashAttention-3's layout) on a prefill case's shapes, dense and causal.
It reads contiguous K and V instead of pages and has no ragged rows, so it shows what Pallas on Mosaic
GPU reaches on this GPU for the same FLOPs. It runs in float16: jax 0.11.2's kernel stages its
probabilities in float16 and refuses bfloat16 inputs (the tensor cores' rate is the same for both)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

DTYPE = jnp.float16
BLOCK_Q = 64  # per compute warpgroup: a CTA takes 2 x 64 query rows of one head
BLOCK_KV = (128, 64)  # tried in this order; the faster one is reported


def dense_inputs(rows: int, seq_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int, seed: int = 0):
    """Random float16 q ``[rows, seq_len, Hq, D]`` and k, v ``[rows, seq_len, Hkv, D]``."""
    keys = jax.random.split(jax.random.key(seed), 3)

    def rand(key, heads):
        return jax.random.normal(key, (rows, seq_len, heads, head_dim), jnp.float32).astype(DTYPE)

    return rand(keys[0], num_q_heads), rand(keys[1], num_kv_heads), rand(keys[2], num_kv_heads)


def dense_attention(block_kv: int):
    """``(q, k, v) -> out`` of the same shape as q: causal, one config."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    config = attention_mgpu.TuningConfig(block_q=BLOCK_Q, block_kv=block_kv, max_concurrent_steps=2, causal=True)
    return lambda q, k, v: attention_mgpu.attention(q, k, v, config)
