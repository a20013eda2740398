"""ragged_paged_attention: Pallas kernel (interpret mode on CPU) vs the jnp reference vs numpy.

The chain of trust: a plain numpy loop (per row, per token, per head softmax) checks the jnp
reference (both of its formulations); the reference then checks the kernel on many ragged
batches. Caches are poisoned with NaN everywhere except the keys a row may read (positions
< seq_len), so any read past seq_len, of a padded block-table entry or of another layer shows
up as NaN. In interpret mode the kernel's output starts as NaN, so every token the kernel
fails to write (padding tokens must be written as 0) shows up too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import ragged_paged_attention as rpa_mod
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference

on_gpu = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not on_gpu, reason="needs a GPU")


# ----------------------------------------------------------------------------------------
# Batch construction and the numpy oracle
# ----------------------------------------------------------------------------------------


def build_batch(
    rows,
    *,
    T,
    R,
    Hq,
    Hkv,
    D,
    bs,
    num_blocks,
    max_blocks,
    num_layers=2,
    layer=1,
    dtype=jnp.float32,
    seed=0,
    poison=np.nan,
):
    """A ragged batch. rows: list of (q_len, ctx_len); at most R rows and T tokens."""
    assert len(rows) <= R and sum(q for q, _ in rows) <= T
    rng = np.random.default_rng(seed)
    block_tables = np.zeros((R, max_blocks), np.int32)  # padded entries -> block 0
    seq_lens = np.zeros(R, np.int32)
    qsl = np.zeros(R + 1, np.int32)
    live = np.zeros((num_blocks, bs), bool)  # slots some row may read
    free = list(rng.permutation(num_blocks))  # shuffled, non-contiguous pages
    for i, (q_len, ctx) in enumerate(rows):
        assert 0 <= q_len <= ctx
        n = -(-ctx // bs)
        assert n <= max_blocks and n <= len(free)
        blocks = [free.pop() for _ in range(n)]
        block_tables[i, :n] = blocks
        for p in range(ctx):
            live[blocks[p // bs], p % bs] = True
        seq_lens[i] = ctx
        qsl[i + 1] = qsl[i] + q_len
    qsl[len(rows) + 1 :] = qsl[len(rows)]
    shape = (num_layers, num_blocks, Hkv, bs, D)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    other_layer = (np.arange(num_layers) != layer)[:, None, None, None, None]
    dead = other_layer | ~live[None, :, None, :, None]
    k = np.where(dead, poison, k)
    v = np.where(dead, poison, v)
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)  # padding tokens too: ignored
    # Round through the dtype so the numpy oracle sees exactly what the kernel sees.
    q, k, v = (x.astype(dtype).astype(np.float32) for x in (q, k, v))
    return dict(
        q=q,
        k=k,
        v=v,
        layer=layer,
        block_tables=block_tables,
        seq_lens=seq_lens,
        qsl=qsl,
        num_seqs=len(rows),
        dtype=dtype,
    )


def device_args(b):
    dt = b["dtype"]
    # Converted on the host and device_put: jnp.asarray would compile a conversion per shape.
    host = (
        b["q"].astype(dt),
        b["k"].astype(dt),
        b["v"].astype(dt),
        np.int32(b["layer"]),
        b["block_tables"],
        b["seq_lens"],
        b["qsl"],
        np.int32(b["num_seqs"]),
    )
    return tuple(jax.device_put(x) for x in host)


def numpy_attention(b, sm_scale, window=None):
    """Plain loops: for every real token and head, softmax over its visible keys (float64)."""
    q, k, v = (b[n].astype(np.float64) for n in ("q", "k", "v"))
    T, Hq, D = q.shape
    Hkv, bs = k.shape[2], k.shape[3]
    G = Hq // Hkv
    out = np.zeros((T, Hq, D))
    qsl, layer = b["qsl"], b["layer"]
    for i in range(b["num_seqs"]):
        q_len, ctx = qsl[i + 1] - qsl[i], b["seq_lens"][i]
        pos_all = np.arange(ctx)
        blocks = b["block_tables"][i, pos_all // bs]
        keys = k[layer, blocks, :, pos_all % bs]  # [ctx, Hkv, D]
        vals = v[layer, blocks, :, pos_all % bs]
        for j in range(q_len):
            t, pos = qsl[i] + j, ctx - q_len + j
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(Hq):
                s = keys[lo : pos + 1, h // G] @ q[t, h] * sm_scale
                w = np.exp(s - s.max())
                out[t, h] = (w / w.sum()) @ vals[lo : pos + 1, h // G]
    return out


def padding_tokens(b):
    return np.arange(b["q"].shape[0]) >= b["qsl"][b["num_seqs"]]


@functools.lru_cache(maxsize=None)
def kernel_fn(**kw):
    return jax.jit(functools.partial(ragged_paged_attention, interpret=not on_gpu, **kw))


@functools.lru_cache(maxsize=None)
def reference_fn(**kw):
    return jax.jit(functools.partial(ragged_paged_attention_reference, **kw))


def check_kernel(b, *, sm_scale=0.25, window=None, tol=1e-5, **tuning):
    out = np.asarray(
        kernel_fn(sm_scale=sm_scale, sliding_window=window, **tuning)(*device_args(b)).astype(jnp.float32)
    )
    ref = np.asarray(
        reference_fn(sm_scale=sm_scale, sliding_window=window)(*device_args(b)).astype(jnp.float32)
    )
    pad = padding_tokens(b)
    assert not np.isnan(out).any(), f"NaN at tokens {np.where(np.isnan(out).any((1, 2)))[0]}"
    np.testing.assert_array_equal(out[pad], 0.0)  # the documented padding value
    if b["dtype"] == jnp.float32:
        np.testing.assert_allclose(out, ref, atol=tol, rtol=0)
    else:
        err = np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-6)
        assert err <= tol, f"relative error {err}"
    return out, ref


# Static shape family shared by most CPU tests (one compile per tuning config).
FAM = dict(T=32, R=6, Hq=4, Hkv=2, D=32, bs=16, num_blocks=48, max_blocks=8)

COMPOSITIONS = {
    # (q_len, ctx_len) per row. Contexts end mid-block and exactly on block edges.
    "all_decode": [(1, 1), (1, 16), (1, 17), (1, 47), (1, 48), (1, 128)],
    "all_prefill": [(12, 12), (16, 16), (3, 3)],
    "chunked_prefill": [(10, 40), (16, 64), (5, 21)],
    "mixed": [(1, 33), (9, 9), (0, 20), (7, 50), (1, 16), (4, 4)],
    "padded_rows_and_tokens": [(2, 30), (0, 5), (1, 80)],
    "full_bucket": [(8, 8), (8, 100), (8, 16), (4, 32), (3, 3), (1, 77)],
    "no_rows": [],
}


# ----------------------------------------------------------------------------------------
# The reference against numpy
# ----------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("formulation", "window"))
def reference_formulation(q, k, v, layer, bt, sl, qsl, ns, *, formulation, window):
    row, pos, valid = rpa_mod._token_metadata(q.shape[0], bt, sl, qsl, ns)
    k_rows = rpa_mod._row_kv(k, layer, bt, sl)
    v_rows = rpa_mod._row_kv(v, layer, bt, sl)
    if formulation == "per_token":
        return rpa_mod._reference_per_token(q, k_rows, v_rows, row, pos, valid, 0.25, window)
    return rpa_mod._reference_per_row(q, k_rows, v_rows, row, pos, valid, qsl, 0.25, window)


@pytest.mark.parametrize("formulation", ["per_token", "per_row"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("name", ["mixed", "chunked_prefill", "all_decode"])
def test_reference_matches_numpy(name, window, formulation):
    b = build_batch(COMPOSITIONS[name], **FAM, seed=1)
    out = reference_formulation(*device_args(b), formulation=formulation, window=window)
    np.testing.assert_allclose(np.asarray(out), numpy_attention(b, 0.25, window), atol=1e-5, rtol=0)


def test_reference_public_entry_picks_both_formulations():
    # Decode-shaped (T == R) and prefill-shaped (R == 1, long T) batches.
    cfg = dict(Hq=4, Hkv=2, D=32, bs=16, num_blocks=24, max_blocks=8)
    for rows, T, R in [([(1, 40)] * 4, 4, 4), ([(60, 100)], 64, 1)]:
        b = build_batch(rows, T=T, R=R, **cfg, seed=2)
        out = reference_fn(sm_scale=0.3)(*device_args(b))
        np.testing.assert_allclose(np.asarray(out), numpy_attention(b, 0.3), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------
# The kernel against the reference (interpret mode on CPU)
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tuning",
    [
        dict(block_m=16, block_n=16, num_kv_splits=1),
        dict(block_m=16, block_n=32, num_kv_splits=4),
        dict(block_m=32, block_n=16, num_kv_splits=2),
    ],
    ids=["m16n16s1", "m16n32s4", "m32n16s2"],
)
@pytest.mark.parametrize("name", sorted(COMPOSITIONS))
def test_kernel_compositions(name, tuning):
    b = build_batch(COMPOSITIONS[name], **FAM, seed=3)
    check_kernel(b, **tuning)


@pytest.mark.parametrize("q_per_kv", [1, 2, 4, 8])
def test_kernel_gqa_ratios(q_per_kv):
    Hkv = 2 if q_per_kv < 8 else 1
    cfg = dict(FAM, Hq=Hkv * q_per_kv, Hkv=Hkv)
    b = build_batch(COMPOSITIONS["mixed"], **cfg, seed=4)
    check_kernel(b, block_m=16, block_n=16, num_kv_splits=2)


@pytest.mark.parametrize("bs", [8, 32])
def test_kernel_other_block_sizes(bs):
    # bs=8: several pages per key chunk; bs=32: several chunks per page.
    cfg = dict(FAM, bs=bs, max_blocks=128 // bs, num_blocks=6 * 128 // bs)
    rows = [(1, 33), (9, 9), (0, 20), (7, 50), (1, 32), (5, 128)]
    b = build_batch(rows, **cfg, seed=5)
    check_kernel(b, block_m=16, block_n=16, num_kv_splits=2)


@pytest.mark.parametrize("window,splits", [(5, 1), (40, 1), (40, 4)])
def test_kernel_sliding_window(window, splits):
    rows = [(1, 100), (20, 60), (0, 3), (6, 6), (1, 41), (4, 128)]
    b = build_batch(rows, **FAM, seed=6)
    np.testing.assert_allclose(
        np.asarray(reference_fn(sm_scale=0.25, sliding_window=window)(*device_args(b))),
        numpy_attention(b, 0.25, window),
        atol=1e-5,
        rtol=0,
    )
    check_kernel(b, window=window, block_m=16, block_n=16, num_kv_splits=splits)


@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_bf16(splits):
    cfg = dict(FAM, D=64)
    b = build_batch(COMPOSITIONS["mixed"], **cfg, dtype=jnp.bfloat16, seed=7)
    check_kernel(b, tol=2e-2, block_m=16, block_n=32, num_kv_splits=splits)


def test_kernel_default_config_and_layer_index():
    # Decode-shaped bucket (T == R) with the default tuning; layer 0 holds the live data.
    rows = [(1, 5), (1, 64), (1, 65), (1, 128)]
    b = build_batch(rows, **dict(FAM, T=4, R=4), layer=0, seed=8)
    check_kernel(b)


@pytest.mark.parametrize("rows", [[(1, 300)], [(8, 300)]], ids=["one_decode_token", "eight_token_chunk"])
def test_default_tuning_splits_the_smallest_bucket_of_one_row(rows):
    # One row in an 8-token bucket (one decode token and padding, or a chunk of 8) gets decode
    # tiles and a KV split, as a decode bucket of 8 rows does; larger one-row buckets do not.
    tuning = rpa_mod.default_tuning(8, 1, 4, 2, 512)
    assert tuning["block_m"] == 16 and tuning["num_kv_splits"] == 4
    assert rpa_mod.default_tuning(32, 1, 4, 2, 512)["num_kv_splits"] == 1
    b = build_batch(rows, **dict(FAM, T=8, R=1, max_blocks=32, num_blocks=40), seed=14)
    check_kernel(b)


def test_kernel_ignores_padded_row_metadata():
    # Rows >= num_seqs are dead whatever their seq_lens/block tables say.
    b = build_batch(COMPOSITIONS["padded_rows_and_tokens"], **FAM, seed=12)
    ns = b["num_seqs"]
    b["seq_lens"][ns:] = 77
    b["block_tables"][ns:] = np.random.default_rng(0).integers(
        0, FAM["num_blocks"], b["block_tables"][ns:].shape
    )
    check_kernel(b, block_m=16, block_n=16, num_kv_splits=2)


def test_kernel_matches_numpy_directly():
    # Guards against a shared bug in kernel and reference: the kernel vs the numpy loops.
    b = build_batch(COMPOSITIONS["mixed"], **FAM, seed=9)
    out, _ = check_kernel(b, block_m=16, block_n=16, num_kv_splits=2)
    np.testing.assert_allclose(out, numpy_attention(b, 0.25), atol=1e-5, rtol=0)


@st.composite
def random_batches(draw):
    R, T, max_ctx = FAM["R"], FAM["T"], FAM["bs"] * FAM["max_blocks"]
    num_rows = draw(st.integers(0, R))
    rows, budget = [], T
    for _ in range(num_rows):
        q_len = draw(st.integers(0, min(budget, 20)))
        ctx = draw(st.integers(max(q_len, 1), max_ctx))
        rows.append((q_len, ctx))
        budget -= q_len
    return rows, draw(st.sampled_from([1, 4])), draw(st.integers(0, 2**16))


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(random_batches())
def test_kernel_random_batches(case):
    rows, splits, seed = case
    b = build_batch(rows, **FAM, seed=seed)
    check_kernel(b, block_m=16, block_n=16, num_kv_splits=splits)


def test_kernel_is_jittable_under_scan_over_layers():
    # The model calls it inside lax.scan over layers with a traced layer index.
    b = build_batch(COMPOSITIONS["mixed"], **FAM, seed=10)
    b["k"], b["v"] = np.nan_to_num(b["k"]), np.nan_to_num(b["v"])
    q, k, v, _, bt, sl, qsl, ns = device_args(b)
    attn = functools.partial(
        ragged_paged_attention, sm_scale=0.25, interpret=not on_gpu, block_m=16, block_n=16, num_kv_splits=1
    )

    @jax.jit
    def run(q, k, v):
        def body(carry, layer):
            return carry, attn(q, k, v, layer, bt, sl, qsl, ns)

        return jax.lax.scan(body, 0, jnp.arange(k.shape[0], dtype=jnp.int32))[1]

    outs = run(q, k, v)
    for layer in range(k.shape[0]):
        ref = reference_fn(sm_scale=0.25, sliding_window=None)(q, k, v, np.int32(layer), bt, sl, qsl, ns)
        np.testing.assert_allclose(np.asarray(outs[layer]), np.asarray(ref), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------
# GPU only: compiled kernel, production head shapes
# ----------------------------------------------------------------------------------------

QWEN3 = dict(Hq=16, Hkv=8, D=128, bs=16)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize(
    "tuning",
    [
        dict(),
        dict(block_m=16, block_n=64, num_kv_splits=8),
        dict(block_m=64, block_n=64, num_kv_splits=1),
        dict(block_m=128, block_n=32, num_warps=8),
        dict(block_m=16, block_n=64, num_kv_splits=1, num_stages=4),
        dict(block_m=64, block_n=64, num_kv_splits=1, num_stages=3),
    ],
    ids=["default", "m16n64s8", "m64n64", "m128n32w8", "m16n64st4", "m64n64st3"],
)
def test_gpu_qwen3_mixed_bf16(tuning):
    rng = np.random.default_rng(11)
    rows = [(1, int(c)) for c in rng.integers(1, 3000, size=24)]
    rows += [(200, 200), (130, 1500), (0, 40), (3, 3001), (64, 2048)]
    b = build_batch(rows, T=512, R=40, **QWEN3, num_blocks=8192, max_blocks=200, dtype=jnp.bfloat16, seed=11)
    check_kernel(b, sm_scale=128**-0.5, tol=2e-2, **tuning)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("splits", [1, 16, 64])
def test_gpu_decode_long_context(splits):
    rows = [(1, 32768), (1, 20000), (1, 17)]
    b = build_batch(
        rows,
        T=4,
        R=4,
        **QWEN3,
        num_blocks=4200,
        max_blocks=2048,
        num_layers=1,
        layer=0,
        dtype=jnp.bfloat16,
        seed=12,
    )
    check_kernel(b, sm_scale=128**-0.5, tol=2e-2, num_kv_splits=splits)


@pytest.mark.gpu
@gpu_only
def test_gpu_f32_and_window():
    b = build_batch(COMPOSITIONS["mixed"], **FAM, seed=13)
    check_kernel(b, block_m=16, block_n=16, num_kv_splits=2)
    check_kernel(b, window=7, block_m=16, block_n=16)
    rows = [(1, 1000), (300, 700), (1, 5)]
    b = build_batch(rows, T=512, R=4, **QWEN3, num_blocks=256, max_blocks=64, dtype=jnp.bfloat16, seed=14)
    check_kernel(b, sm_scale=128**-0.5, window=256, tol=2e-2)

