"""ragged_paged_attention_qkv (q/k norm + RoPE, the KV write and attention in one kernel, for rows of one
token) in the Pallas interpreter against its two-step jnp reference: qk_norm_rope_kv_write_reference, then
ragged_paged_attention_reference (both tested against numpy loops in their own files).

The new tokens' slots hold NaN before the call, so a kernel that attended to the cache's stale key instead
of the new one, or wrote the wrong slot, shows; every other slot must keep its value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.qk_norm_rope_kv_write import qk_norm_rope_kv_write_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_qkv, ragged_paged_attention_reference

H, HKV, D, BS, NB, MB, L = 4, 2, 32, 4, 96, 40, 2
EPS = 1e-6
ON_GPU = jax.default_backend() == "gpu"  # there the real kernel runs (pytest -m "gpu or not gpu")


def decode_batch(contexts, *, T, R, dtype, seed=0, stacked_norms=False):
    """One token a row at position ctx - 1 (its slot poisoned), rows padded to R, tokens to T."""
    rng = np.random.default_rng(seed)
    block_tables = np.zeros((R, MB), np.int32)
    seq_lens, qsl, slots = np.zeros(R, np.int32), np.zeros(R + 1, np.int32), np.full(T, -1, np.int32)
    free = list(rng.permutation(NB))
    cache = rng.standard_normal((2, L, NB, HKV, BS, D)).astype(np.float32)
    for i, ctx in enumerate(contexts):
        blocks = [free.pop() for _ in range(-(-ctx // BS))]
        block_tables[i, :len(blocks)] = blocks
        seq_lens[i], qsl[i + 1] = ctx, i + 1
        slots[i] = blocks[(ctx - 1) // BS] * BS + (ctx - 1) % BS
        cache[:, 1, slots[i] // BS, :, slots[i] % BS] = np.nan  # the new key's slot: stale until written
    qsl[len(contexts) + 1:] = len(contexts)
    positions = np.zeros(T, np.int64)
    positions[:len(contexts)] = np.asarray(contexts) - 1
    inv_freq = 1.0 / 10000 ** (np.arange(0, D, 2) / D)
    angles = (positions[:, None] * inv_freq[None, :]).astype(np.float32)
    norms = rng.uniform(0.5, 1.5, (2, L, D) if stacked_norms else (2, D)).astype(np.float32)
    qkv = (rng.standard_normal((T, (H + 2 * HKV) * D)) * 2).astype(np.float32)
    put = lambda a, dt=None: jax.device_put(a if dt is None else a.astype(dt))  # noqa: E731
    return dict(qkv=put(qkv, dtype), q_norm=put(norms[0], dtype), k_norm=put(norms[1], dtype),
                cos=put(np.cos(angles)), sin=put(np.sin(angles)), k_cache=put(cache[0], dtype),
                v_cache=put(cache[1], dtype), slot_mapping=put(slots), layer=np.int32(1),
                block_tables=put(block_tables), seq_lens=put(seq_lens), query_start_loc=put(qsl),
                num_seqs=np.int32(len(contexts)))


def run_both(b, *, with_norm=True, norm_layer=None, **tuning):
    norms = (b["q_norm"], b["k_norm"]) if with_norm else (None, None)
    meta = (b["block_tables"], b["seq_lens"], b["query_start_loc"], b["num_seqs"])
    got = ragged_paged_attention_qkv(b["qkv"], *norms, b["cos"], b["sin"], b["k_cache"], b["v_cache"],
                                     b["slot_mapping"], b["layer"], *meta, num_heads=H, sm_scale=D**-0.5, eps=EPS,
                                     norm_layer=norm_layer, interpret=not ON_GPU, **tuning)
    q, k_cache, v_cache = qk_norm_rope_kv_write_reference(b["qkv"], *norms, b["cos"], b["sin"], b["k_cache"],
                                                          b["v_cache"], b["slot_mapping"], b["layer"], num_heads=H,
                                                          eps=EPS, norm_layer=norm_layer)
    out = ragged_paged_attention_reference(q, k_cache, v_cache, b["layer"], *meta, sm_scale=D**-0.5)
    return got, (out, k_cache, v_cache)


def check(got, want, tol):
    (out, k_cache, v_cache), (ref_out, ref_k, ref_v) = got, want
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), rtol=tol, atol=tol)
    for cache, ref in ((k_cache, ref_k), (v_cache, ref_v)):
        cache, ref = np.asarray(cache, np.float32), np.asarray(ref, np.float32)
        same = np.isnan(ref) == np.isnan(cache)
        assert same.all(), "NaN where the reference has none, or the other way round"
        np.testing.assert_allclose(cache[~np.isnan(ref)], ref[~np.isnan(ref)], rtol=tol, atol=tol)


# Contexts: a first token (1), a new key that ends a 64-key chunk (64: no mask on its chunk), one that
# starts a chunk (65), and others; with 1, 2 and 4 KV splits.
CONTEXTS = [1, 64, 65, 37, 130, 17]


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_decode_rows_match_the_two_kernels_reference(splits):
    b = decode_batch(CONTEXTS, T=8, R=8, dtype=np.float32)
    check(*run_both(b, num_kv_splits=splits), tol=2e-5)


def test_bf16_without_norms_and_padding_rows():
    b = decode_batch(CONTEXTS[:4], T=8, R=6, dtype=jnp.bfloat16, seed=1)
    check(*run_both(b, with_norm=False, num_kv_splits=2), tol=2e-2)


def test_stacked_norm_weights_at_a_traced_row():
    b = decode_batch(CONTEXTS, T=8, R=8, dtype=np.float32, seed=2, stacked_norms=True)
    got, want = run_both(b, norm_layer=jnp.int32(1), num_kv_splits=4)
    check(got, want, tol=2e-5)


def test_bad_projection_width_is_refused():
    b = decode_batch(CONTEXTS, T=8, R=8, dtype=np.float32)
    with pytest.raises(ValueError, match="qkv"):
        ragged_paged_attention_qkv(b["qkv"][:, :-D], b["q_norm"], b["k_norm"], b["cos"], b["sin"], b["k_cache"],
                                   b["v_cache"], b["slot_mapping"], b["layer"], b["block_tables"], b["seq_lens"],
                                   b["query_start_loc"], b["num_seqs"], num_heads=H, sm_scale=0.1, interpret=not ON_GPU)


@pytest.mark.parametrize("rows", [1, 32])
def test_it_lowers_to_triton_at_qwen3_shapes(triton_lowering_without_a_gpu, rows):
    """Pallas's Triton lowering at Qwen3-0.6B's shapes (a block op Triton lacks, such as a slice, fails it)."""
    S, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    cache = S((28, 512, 8, 16, 128), bf16)
    args = (S((rows, 4096), bf16), S((28, 128), bf16), S((28, 128), bf16), S((rows, 64), jnp.float32),
            S((rows, 64), jnp.float32), cache, cache, S((rows,), i32), S((), i32), S((rows, 64), i32), S((rows,), i32),
            S((rows + 1,), i32), S((), i32), S((), i32))

    def attend(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, layer, tables, lens, starts, num_seqs, row):
        return ragged_paged_attention_qkv(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, layer, tables, lens,
                                          starts, num_seqs, num_heads=16, sm_scale=128**-0.5, norm_layer=row)

    jax.jit(attend).trace(*args).lower(lowering_platforms=("cuda",))
