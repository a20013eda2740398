"""The GEMV path (models/gemv_projections.py): a forward of one token or a few with
`CausalLM.gemv_projections` runs every projection of Qwen3 and GLM-4 through the GEMV kernels (Pallas's
interpreter on the CPU) and gives the logits of the plain XLA forward, which the Hugging Face parity
tests cover; more tokens than the kernel takes, or shapes it does not tile, take the XLA math unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import Glm4Config, Qwen3Config

from mrv2_jax.models.attention import DenseAttention
from mrv2_jax.models.model_state import model_state_for

# Sizes the kernel tiles (K a multiple of 256), two layers.
DIMS = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, num_hidden_layers=2, max_position_embeddings=128, rms_norm_eps=1e-6)
CONFIGS = {"qwen3": lambda **kw: Qwen3Config(**(DIMS | kw), architectures=["Qwen3ForCausalLM"]),
           "glm4": lambda **kw: Glm4Config(**(DIMS | kw), architectures=["Glm4ForCausalLM"])}


def model(family, **overrides):
    spec = model_state_for(CONFIGS[family](**overrides))
    lm = spec.build_model(dtype=jnp.bfloat16, seed=3)
    # Random norm weights too (they start at one), so that a norm applied in the wrong place shows.
    for group in spec.layer_groups():
        stack = getattr(lm, group)
        for name in stack.names:
            if "norm" in name:
                param = getattr(stack, name)
                noise = jax.random.normal(jax.random.key(len(name)), param[...].shape) * 0.2
                param.set_value((1 + noise).astype(jnp.bfloat16))
    return spec, lm


def logits_and_jaxpr(lm, ids, gemv_projections, unroll):
    lm.gemv_projections, lm.layer_unroll = gemv_projections, unroll
    positions = jnp.arange(ids.shape[0], dtype=jnp.int32) + 5

    def forward(ids):
        hidden, _ = lm(ids, positions, DenseAttention(jnp.zeros_like(ids), positions))
        return lm.compute_logits(hidden)

    return np.asarray(jax.jit(forward)(ids)), str(jax.make_jaxpr(forward)(ids))


@pytest.mark.parametrize("family,unroll,tokens", [("qwen3", True, 1), ("glm4", 1, 1), ("qwen3", True, 3)])
def test_a_few_tokens_through_the_gemv_kernels_give_the_xla_logits(family, unroll, tokens):
    _, lm = model(family)
    ids = jnp.asarray([17, 4, 9][:tokens], jnp.int32)
    expected, _ = logits_and_jaxpr(lm, ids, False, unroll)
    got, jaxpr = logits_and_jaxpr(lm, ids, True, unroll)
    # Each kernel call is a pallas_call named gemv_triton: every projection of the layer
    # (Qwen3: norm + qkv, o + residual, norm + gate/up + SwiGLU, down + residual; GLM-4 the same with
    # its o and down plain), in the layer scan's one body (XLA unrolls it later).
    assert jaxpr.count("name=gemv_triton") == 4
    # The SwiGLU is the kernel's (exp-based), not XLA's (jax.nn.silu: a `logistic`).
    assert "logistic" not in jaxpr
    # The kernel rounds once where XLA rounds the norm's output and each product: a few bf16 steps.
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, atol=0.03 * scale, rtol=0)
    margin = np.sort(expected, axis=-1)[:, -1] - np.sort(expected, axis=-1)[:, -2]
    clear = margin > 0.06 * scale  # tokens whose top logit is not a near-tie
    np.testing.assert_array_equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])


def test_more_tokens_or_untileable_shapes_take_the_xla_math_unchanged():
    """33 tokens (more rows than the kernel takes), or a hidden size of 64 (not a multiple of the kernel's
    256-wide K tiles): no kernel runs and the logits are exactly the plain forward's."""
    for ids, overrides in ((jnp.arange(33, dtype=jnp.int32) * 7 % 512, {}),
                           (jnp.asarray([17], jnp.int32), dict(hidden_size=64, head_dim=16, intermediate_size=96))):
        _, lm = model("qwen3", **overrides)
        expected, _ = logits_and_jaxpr(lm, ids, False, True)
        got, jaxpr = logits_and_jaxpr(lm, ids, True, True)
        assert "name=gemv_triton" not in jaxpr
        np.testing.assert_array_equal(got, expected)


def test_a_stack_past_int32_offsets_takes_the_xla_math():
    """A stack of 2**31 elements or more (Qwen3-8B's gate_up) is left to XLA; Qwen3-0.6B's is the kernel's."""
    from mrv2_jax.models.gemv_projections import _kernel_takes
    from mrv2_jax.models.layer_weight import LayerWeight

    S, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    assert _kernel_takes(S((1, 1024), bf16), LayerWeight(S((28, 6144, 1024), bf16), 0))
    assert not _kernel_takes(S((1, 4096), bf16), LayerWeight(S((36, 24576, 4096), bf16), 0))
