"""The small-batch projections (models/projections.py): with the skinny GEMM kernel reading the stacked
weights in place (Mosaic GPU's interpreter on the CPU), both dense families compute the logits of
XLA's dot, with the layer loop scanned or unrolled; the kernel really runs (the program holds its
calls); a projection whose shape the kernel cannot take falls back to the dot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrv2_jax.models.attention import DenseAttention
from mrv2_jax.models.loader import load_model
from mrv2_jax.models.projections import LayerWeight, SkinnyProjection
from tests.parity import FIXTURES


def logits_of(lm, ids, projection, unroll):
    lm.projection, lm.layer_unroll = projection, unroll
    positions = jnp.arange(len(ids), dtype=jnp.int32)

    def forward(ids):
        hidden, _ = lm(ids, positions, DenseAttention(jnp.zeros_like(ids), positions))
        return lm.compute_logits(hidden)

    return forward, np.asarray(jax.jit(forward)(ids))


@pytest.mark.parametrize("unroll", [1, True])
@pytest.mark.parametrize("name", ["qwen3-tiny", "glm4-tiny"])
def test_skinny_projections_give_the_dot_s_logits(name, unroll):
    spec, lm, _ = load_model(FIXTURES / name, dtype="bfloat16")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, spec.vocab_size, 5), jnp.int32)
    _, expected = logits_of(lm, ids, None, unroll)
    forward, got = logits_of(lm, ids, SkinnyProjection(interpret=True), unroll)
    # Each projection rounds to bf16 after summing K in another order: a bf16 step or two of the logits.
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32), atol=0.03 * scale, rtol=0)
    margin = np.sort(expected, axis=-1)[:, -1] - np.sort(expected, axis=-1)[:, -2]
    clear = margin > 0.06 * scale
    assert clear.any()
    np.testing.assert_array_equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])
    # The kernel runs for the projections it can take: qkv, o and gate_up (K = 64); down_proj (K = 96,
    # not a multiple of 64) falls back to the dot. The jaxpr holds the scan's one body either way (XLA
    # unrolls it); Mosaic GPU's interpreter traces each kernel call as an `mpmd_map` over the kernel's body.
    text = str(jax.make_jaxpr(forward)(ids))
    assert text.count("mpmd_map[") == 3


def test_fallback_where_the_kernel_does_not_fit():
    """A LayerWeight answers `x @ w` like its layer's slice wherever the kernel does not fit (too many
    rows, float32)."""
    stack = jax.random.normal(jax.random.key(0), (3, 64, 128), jnp.float32)
    w = LayerWeight(stack, jnp.int32(2), SkinnyProjection(interpret=True))
    x = jax.random.normal(jax.random.key(1), (40, 64), jnp.float32)
    np.testing.assert_allclose(np.asarray(x @ w), np.asarray(x @ stack[2]), rtol=1e-6)
    xb, wb = x[:33].astype(jnp.bfloat16), LayerWeight(stack.astype(jnp.bfloat16), 1, SkinnyProjection(interpret=True))
    np.testing.assert_array_equal(np.asarray(xb @ wb, np.float32), np.asarray(xb @ stack[1].astype(jnp.bfloat16),
                                                                              np.float32))


@pytest.mark.parametrize("unroll", [1, True])
def test_the_demo_model_with_skinny_projections_lowers_for_cuda(unroll):
    """The real Mosaic GPU lowering of every projection the kernel takes in a whole model's forward
    (the demo checkpoint, bf16: all four projections fit), the layer a scan index or unrolled."""
    spec, lm, _ = load_model(FIXTURES.parent.parent / "checkpoints" / "demo-qwen3", dtype="bfloat16")
    lm.projection, lm.layer_unroll = SkinnyProjection(), unroll
    positions = jnp.arange(8, dtype=jnp.int32)

    def forward(ids):
        hidden, _ = lm(ids, positions, DenseAttention(jnp.zeros_like(ids), positions))
        return lm.compute_logits(hidden)

    ids = jax.ShapeDtypeStruct((8,), jnp.int32)
    text = jax.jit(forward).trace(ids).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 4 * (spec.num_layers if unroll is True else 1)
