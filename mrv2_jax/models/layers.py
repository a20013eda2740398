"""Building blocks shared by the model families: norms, rotary embeddings, MLP, dense attention.

All functions are pure and work on a flattened token axis `T` (a batch of requests
concatenated), which is the shape the engine feeds the model every step.
"""

import jax
import jax.numpy as jnp

from mrv2_jax.models.tensor_parallel import row_parallel, split_sharded


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 and cast back, as the Hugging Face Qwen/GLM code does."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x [..., in] @ w.T` for a linear weight `w [out, in]`, the layout checkpoints store it in: each
    output's weights contiguous, what a one-row product streams best (GEMMs take either layout)."""
    return jnp.einsum("...i,oi->...o", x, w)


def rope_angles(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin of shape [T, rotary_dim // 2] for the standard RoPE frequency ladder."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope_halves(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs (i, i + d/2) over the whole head ("neox" style, used by Qwen).

    x: [T, heads, head_dim]; cos/sin: [T, head_dim // 2].
    """
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return rotated.astype(x.dtype)


def apply_rope_interleaved_partial(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate adjacent pairs (2i, 2i + 1) of the first `2 * cos.shape[-1]` dims (GLM-4 style).

    The remaining dims pass through unchanged (partial rotary).
    """
    rotary_dim = 2 * cos.shape[-1]
    rot = x[..., :rotary_dim].astype(jnp.float32)
    even, odd = rot[..., 0::2], rot[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = jnp.stack([even * c - odd * s, odd * c + even * s], axis=-1).reshape(rot.shape)
    return jnp.concatenate([rotated.astype(x.dtype), x[..., rotary_dim:]], axis=-1)


def gated_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, shards: int = 1) -> jax.Array:
    """SwiGLU MLP with the gate and up projections fused into one matmul (`gate_up` [2I, H]: gate's
    rows, then up's). `shards` > 1: `gate_up` is in the tensor-parallel layout of that many devices
    (models/tensor_parallel.py)."""
    if shards == 1:
        gate, up = jnp.split(linear(x, gate_up), 2, axis=-1)
    else:
        gate, up = split_sharded(linear(x, gate_up), (gate_up.shape[0] // 2,) * 2, shards)
    return row_parallel(jax.nn.silu(gate) * up, down, shards)


def split_qkv(qkv: jax.Array, num_heads: int, num_kv_heads: int, head_dim: int, shards: int = 1):
    """Split a fused [T, (H + 2 Hkv) * D] projection into q [T, H, D], k and v [T, Hkv, D].
    `shards` > 1: the projection's weight is in the tensor-parallel layout of that many devices
    (models/tensor_parallel.py)."""
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if shards > 1:
        q, k, v = split_sharded(qkv, (q_size, kv_size, kv_size), shards)
        return (q.reshape(t, num_heads, head_dim), k.reshape(t, num_kv_heads, head_dim),
                v.reshape(t, num_kv_heads, head_dim))
    q = qkv[:, :q_size].reshape(t, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].reshape(t, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].reshape(t, num_kv_heads, head_dim)
    return q, k, v


def dense_causal_attention(q, k, v, segment_ids, positions, scale):
    """Reference attention over the flattened batch: token i sees token j iff they belong to
    the same segment (request) and pos_j <= pos_i. O(T^2); used for tests and training.

    q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D].
    """
    t, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    qg = q.reshape(t, k.shape[1], group, head_dim).astype(jnp.float32)
    scores = jnp.einsum("qhgd,khd->hgqk", qg, k.astype(jnp.float32)) * scale
    visible = (segment_ids[:, None] == segment_ids[None, :]) & (positions[None, :] <= positions[:, None])
    scores = jnp.where(visible[None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("hgqk,khd->qhgd", probs, v.astype(jnp.float32))
    return out.reshape(t, num_heads, head_dim).astype(q.dtype)


def apply_rope_halves_partial(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """"Halves" RoPE on the first `2 * cos.shape[-1]` dims only; the rest pass through
    (GLM-4.5 / GLM-4-MoE partial rotary)."""
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rope_halves(x, cos, sin)
    return jnp.concatenate([apply_rope_halves(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], axis=-1)
