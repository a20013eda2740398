"""A program that calls one Mosaic GPU kernel several times at the same shapes (a model's unrolled
layers) holds one kernel for XLA to compile, not one per call: the wrappers are jitted
(mgpu_common.one_kernel_per_shape), where plain calls would each be lowered into a module of their own,
named by JAX's process-wide counter, and so carry a kernel hash of their own. Checked on the StableHLO
of the real lowering for CUDA, which any backend can produce."""

import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.grouped_gemm_mgpu import grouped_gemm_mgpu
from pallas_kernels.paged_decode_attention_mgpu import paged_decode_attention_mgpu
from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu

S = jax.ShapeDtypeStruct
ROWS, HQ, HKV, D, BS, CTX, LAYERS = 8, 16, 8, 128, 16, 256, 3


def kernel_hashes(fn, *shapes) -> list[str]:
    """The kernel hash of every Mosaic GPU custom call in fn's StableHLO for CUDA."""
    text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    return re.findall(r'@mosaic_gpu\w*\(.*?kernel_hash = "(.*?)"', text)


def attention_shapes():
    cache = S((LAYERS, ROWS * CTX // BS + 1, HKV, BS, D), jnp.bfloat16)
    return (S((ROWS, HQ, D), jnp.bfloat16), cache, cache, S((ROWS, CTX // BS), jnp.int32), S((ROWS,), jnp.int32),
            S((), jnp.int32))


def every_layer_ragged(q, k, v, block_tables, seq_lens, num_seqs):
    qsl = jnp.arange(ROWS + 1, dtype=jnp.int32)
    for layer in range(LAYERS):  # unrolled: the layer a constant, as in the engine's unrolled buckets
        q = ragged_paged_attention_mgpu(q, k, v, layer, block_tables, seq_lens, qsl, num_seqs, sm_scale=D**-0.5)
    return q


def every_layer_decode(q, k, v, block_tables, seq_lens, num_seqs):
    for layer in range(LAYERS):
        q = paged_decode_attention_mgpu(q, k, v, block_tables, seq_lens, num_seqs, layer=layer, sm_scale=D**-0.5)
    return q


def every_layer_experts(x, experts, group_sizes):
    for layer in range(LAYERS):
        x = grouped_gemm_mgpu(x, experts[layer], group_sizes)
    return x


@pytest.mark.parametrize("fn,shapes", [
    (every_layer_ragged, attention_shapes()),
    (every_layer_decode, attention_shapes()),
    (every_layer_experts, (S((64, 256), jnp.bfloat16), S((LAYERS, 8, 256, 256), jnp.bfloat16), S((8,), jnp.int32))),
], ids=["ragged_attention", "decode_attention", "grouped_gemm"])
def test_one_kernel_for_every_call_at_one_shape(fn, shapes):
    hashes = kernel_hashes(fn, *shapes)
    assert hashes, "no Mosaic GPU custom call found in the lowering"
    assert len(set(hashes)) == 1, f"{len(set(hashes))} distinct kernels for {LAYERS} calls at one shape"
