"""`CausalLM`: a decoder-only language model whose per-layer weights are stacked.

Every per-layer weight of the same kind lives in ONE array with a leading layer axis, and the
layers run as a `lax.scan` over that axis. Two reasons: a jitted call costs ~0.6 us of host
time per argument leaf, so ~15 stacked leaves instead of ~300 per-layer ones keeps dispatch
cheap; and the scan carries the stacked KV cache, which XLA then updates in place.
The family-specific math (norm placement, rotary variant, ...) comes from the `ModelState`.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from mrv2_jax.models.attention import DenseAttention
from mrv2_jax.models.layers import rms_norm


class StackedLayers(nnx.Module):
    """Holds one `nnx.Param` per layer-weight kind, each shaped [num_layers, ...]."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], num_layers: int, dtype, rngs: nnx.Rngs):
        self.names = tuple(sorted(shapes))
        for name in self.names:
            setattr(self, name, nnx.Param(init_weight(name, (num_layers, *shapes[name]), dtype, rngs)))

    def arrays(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in self.names}


def init_weight(name: str, shape, dtype, rngs: nnx.Rngs) -> jax.Array:
    """Norm scales start at one, everything else small and random (std 0.02)."""
    if "norm" in name:
        return jnp.ones(shape, dtype)
    return (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class CausalLM(nnx.Module):
    def __init__(self, spec, dtype, rngs: nnx.Rngs, layer_unroll: int | bool = 1):
        self.spec = spec  # the ModelState; static, not a parameter
        self.layer_unroll = layer_unroll
        h, v = spec.hidden_size, spec.vocab_size
        self.embed_tokens = nnx.Param(init_weight("embed_tokens", (v, h), dtype, rngs))
        self.layers = StackedLayers(spec.layer_param_shapes(), spec.num_layers, dtype, rngs)
        self.final_norm = nnx.Param(init_weight("final_norm", (h,), dtype, rngs))
        if not spec.tie_word_embeddings:
            self.lm_head = nnx.Param(init_weight("lm_head", (h, v), dtype, rngs))

    def __call__(self, input_ids, positions, attention, kv_cache=()):
        """Flattened tokens -> (final hidden states [T, H], updated kv_cache)."""
        x = self.embed_tokens[...][input_ids]
        rope = self.spec.rope(positions)

        def one_layer(carry, xs):
            x, kv = carry
            params, layer = xs
            x, kv = self.spec.layer_forward(params, x, rope, attention, layer, kv)
            return (x, kv), None

        layer_ids = jnp.arange(self.spec.num_layers, dtype=jnp.int32)
        (x, kv_cache), _ = jax.lax.scan(
            one_layer, (x, kv_cache), (self.layers.arrays(), layer_ids), unroll=self.layer_unroll)
        return rms_norm(x, self.final_norm[...], self.spec.rms_norm_eps), kv_cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """[N, H] -> float32 [N, vocab]."""
        if self.spec.tie_word_embeddings:
            return jnp.einsum("nh,vh->nv", hidden, self.embed_tokens[...],
                              preferred_element_type=jnp.float32)
        return jnp.dot(hidden, self.lm_head[...], preferred_element_type=jnp.float32)

    def forward_dense(self, input_ids, positions, segment_ids):
        """Logits for every token, attending within segments (tests and training)."""
        hidden, _ = self(input_ids, positions, DenseAttention(segment_ids, positions))
        return self.compute_logits(hidden)
