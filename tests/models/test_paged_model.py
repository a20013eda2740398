"""The model on the paged KV cache equals the dense reference, however the prompt is chunked."""

import jax.numpy as jnp
import numpy as np
import pytest

from mrv2_jax.models.loader import load_model
from mrv2_jax.runner.kv_cache import allocate_kv_cache
from tests.parity import FIXTURES, dense_logits, paged_chunk_logits

BLOCK_SIZE = 4


def paged_logits_in_chunks(name, prompt, chunk, use_kernels):
    spec, lm, _ = load_model(FIXTURES / name, dtype="float32")
    kv = allocate_kv_cache(spec, num_blocks=16, block_size=BLOCK_SIZE, dtype=jnp.float32)
    # A shuffled block table: pages need not be contiguous.
    blocks = np.random.default_rng(0).permutation(16)[: -(-len(prompt) // BLOCK_SIZE)].astype(np.int32)
    table = np.zeros((2, 8), np.int32)  # row 1 is a padded row
    table[0, : len(blocks)] = blocks
    logits = []
    for start in range(0, len(prompt), chunk):
        ids = np.asarray(prompt[start : start + chunk], np.int32)
        n, pad = len(ids), 8 * -(-len(ids) // 8)  # pad the token axis like a bucket
        pos = np.arange(start, start + n, dtype=np.int32)
        slots = np.full(pad, -1, np.int32)
        slots[:n] = blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        chunk_logits, kv = paged_chunk_logits(lm, kv, np.pad(ids, (0, pad - n)), np.pad(pos, (0, pad - n)),
                                              (slots, table, [start + n, 0], [0, n, n], 1),
                                              use_kernels=use_kernels, interpret=use_kernels)
        logits.append(np.asarray(chunk_logits[:n]))
    dense = dense_logits(lm, prompt, np.arange(len(prompt)), np.zeros(len(prompt)))
    return np.concatenate(logits), np.asarray(dense)


@pytest.mark.parametrize("chunk", [1, 7, 23])
@pytest.mark.parametrize("name", ["qwen3-tiny", "glm4-tiny"])
def test_chunked_paged_prefill_matches_dense(name, chunk):
    prompt = list(np.random.default_rng(1).integers(0, 96, 23))
    paged, dense = paged_logits_in_chunks(name, prompt, chunk, use_kernels=False)
    assert np.abs(paged - dense).max() <= 1e-4


@pytest.mark.slow
# The three ways into qk_norm_rope_kv_write: q/k norm with full rotary, with partial rotary, no norm.
@pytest.mark.parametrize("name", ["qwen3-tiny", "glm4-moe-tiny", "glm4-moe-tiny-plain"])
def test_chunked_paged_prefill_with_pallas_kernels_matches_dense(name):
    prompt = list(np.random.default_rng(2).integers(0, 96, 11))
    paged, dense = paged_logits_in_chunks(name, prompt, 7, use_kernels=True)
    assert np.abs(paged - dense).max() <= 1e-4


@pytest.mark.parametrize("unroll", [1, True])
def test_the_qk_kernel_reads_the_stacked_norm_weights_in_place(monkeypatch, unroll):
    """ModelState.in_place_weights: the q/k norm weights reach the fused qk kernel as the whole
    [L, D] stacks with the layer's row (a slice handed to a custom call would be copied each layer),
    with the layer loop scanned or unrolled."""
    import jax

    from mrv2_jax.models.attention import PagedAttention
    from pallas_kernels import qk_norm_rope_kv_write as qk

    spec, lm, _ = load_model(FIXTURES / "qwen3-tiny", dtype="float32")
    lm.layer_unroll = unroll
    kv = allocate_kv_cache(spec, num_blocks=4, block_size=BLOCK_SIZE, dtype=jnp.float32)
    seen, kernel = [], qk.qk_norm_rope_kv_write
    monkeypatch.setattr(qk, "qk_norm_rope_kv_write",
                        lambda *a, **kw: seen.append((kw["q_norm"].shape, kw.get("norm_layer"))) or kernel(*a, **kw))
    ids = jnp.zeros(8, jnp.int32)
    attention = PagedAttention(jnp.full(8, -1, jnp.int32), jnp.zeros((1, 4), jnp.int32), jnp.zeros(1, jnp.int32),
                               jnp.array([0, 8], jnp.int32), jnp.int32(1), use_kernels=True, interpret=True)
    jax.make_jaxpr(lambda ids: lm(ids, jnp.arange(8, dtype=jnp.int32), attention, kv))(ids)
    assert seen and all(shape == (spec.num_layers, spec.head_dim) and row is not None for shape, row in seen)


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_the_layer_scan_takes_its_indices_as_constants(name):
    """The layer loop's indices reach its scan as constants, not as an iota computed in the program: where
    XLA unrolls the scan it folds a constant's per-layer slices to literals, but keeps an iota's as
    one-thread kernels on the GPU (one a layer)."""
    import jax

    from mrv2_jax.models.attention import PagedAttention

    spec, lm, _ = load_model(FIXTURES / name, dtype="float32")
    lm.layer_unroll = True
    kv = allocate_kv_cache(spec, num_blocks=4, block_size=BLOCK_SIZE, dtype=jnp.float32)
    attention = PagedAttention(jnp.full(8, -1, jnp.int32), jnp.zeros((1, 4), jnp.int32), jnp.zeros(1, jnp.int32),
                               jnp.array([0, 8], jnp.int32), jnp.int32(1), use_kernels=False)
    jaxpr = jax.make_jaxpr(lambda ids: lm(ids, jnp.arange(8, dtype=jnp.int32), attention, kv))(
        jnp.zeros(8, jnp.int32)).jaxpr
    made_by = {v: eqn.primitive.name for eqn in jaxpr.eqns for v in eqn.outvars}
    scans = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan"]
    indices = [v for eqn in scans for v in eqn.invars
               if hasattr(v, "aval") and v.aval.dtype == jnp.int32 and v.aval.ndim == 1]
    assert scans and indices
    assert all(made_by.get(v) != "iota" for v in indices), [made_by.get(v) for v in indices]
