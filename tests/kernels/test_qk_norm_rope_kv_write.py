"""qk_norm_rope_kv_write: the Pallas kernel (interpret mode on CPU) vs its jnp reference, and the
reference vs a plain numpy loop over tokens and heads.

The cache is poisoned with NaN; afterwards the written slots hold the new K/V and every other slot
keeps its bits. q is compared to within the rounding of its dtype (the kernel may contract the
rotation into FMAs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.qk_norm_rope_kv_write import qk_norm_rope_kv_write, qk_norm_rope_kv_write_reference

on_gpu = jax.default_backend() == "gpu"
EPS = 1e-6


def make_case(*, T, H=4, Hkv=2, D=32, rotary_dim=None, L=2, NB=6, bs=4, n_pad=2, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    rotary_dim = rotary_dim or D
    qkv = (rng.standard_normal((T, (H + 2 * Hkv) * D)) * 3).astype(np.float32)
    q_norm, k_norm = rng.uniform(0.5, 1.5, (2, D)).astype(np.float32)
    pos = rng.integers(0, 500, T)
    inv_freq = 1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = (pos[:, None] * inv_freq[None, :]).astype(np.float32)
    cache = rng.standard_normal((2, L, NB, Hkv, bs, D)).astype(np.float32)
    cache.reshape(-1)[rng.random(cache.size) < 0.1] = np.nan
    slots = rng.choice(NB * bs, size=T, replace=False).astype(np.int32)
    slots[rng.choice(T, size=min(n_pad, T - 1), replace=False)] = -1
    arrays = dict(qkv=qkv.astype(dtype), q_norm=q_norm.astype(dtype), k_norm=k_norm.astype(dtype),
                  cos=np.cos(angles), sin=np.sin(angles), k_cache=cache[0].astype(dtype),
                  v_cache=cache[1].astype(dtype), slot_mapping=slots)
    return {name: jax.device_put(a) for name, a in arrays.items()}, H


def numpy_loop(case, num_heads, layer, with_norm):
    """Token by token, head by head, in float64: norm, rotate pairs (i, i + r/2), write."""
    qkv = np.asarray(case["qkv"], np.float64)
    k_cache, v_cache = (np.array(case[n], np.float64) for n in ("k_cache", "v_cache"))
    _, _, hkv, bs, d = k_cache.shape
    half = case["cos"].shape[1]
    q = np.zeros((qkv.shape[0], num_heads, d))
    for t in range(qkv.shape[0]):
        c, s = np.asarray(case["cos"][t], np.float64), np.asarray(case["sin"][t], np.float64)
        for h in range(num_heads + hkv):
            x = qkv[t, h * d : (h + 1) * d].copy()
            if with_norm:
                w = np.asarray(case["q_norm" if h < num_heads else "k_norm"], np.float64)
                x = w * x / np.sqrt(np.mean(x * x) + EPS)
            x1, x2 = x[:half].copy(), x[half : 2 * half].copy()
            x[:half], x[half : 2 * half] = x1 * c - x2 * s, x2 * c + x1 * s
            slot = case["slot_mapping"][t]
            if h < num_heads:
                q[t, h] = x
            elif slot >= 0:
                kh = h - num_heads
                k_cache[layer, slot // bs, kh, slot % bs] = x
                v_cache[layer, slot // bs, kh, slot % bs] = qkv[t, (num_heads + hkv + kh) * d :][:d]
    return q, k_cache, v_cache


@functools.lru_cache(maxsize=None)
def jitted(fn, num_heads, with_norm):
    def run(case, layer):
        q_norm, k_norm = (case["q_norm"], case["k_norm"]) if with_norm else (None, None)
        return fn(case["qkv"], q_norm, k_norm, case["cos"], case["sin"], case["k_cache"], case["v_cache"],
                  case["slot_mapping"], layer, num_heads=num_heads, eps=EPS,
                  **({"interpret": not on_gpu} if fn is qk_norm_rope_kv_write else {}))
    return jax.jit(run)


def bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def check(case, num_heads, layer, with_norm=True, q_tol=2e-6):
    q, k_cache, v_cache = jitted(qk_norm_rope_kv_write, num_heads, with_norm)(case, np.int32(layer))
    q_ref, k_ref, v_ref = jitted(qk_norm_rope_kv_write_reference, num_heads, with_norm)(case, np.int32(layer))
    scale = np.abs(np.asarray(q_ref, np.float32)).max()
    np.testing.assert_allclose(np.asarray(q, np.float32), np.asarray(q_ref, np.float32), atol=q_tol * scale)
    # The cache: written slots to the same tolerance, every other slot bit for bit (NaN poison kept).
    np.testing.assert_array_equal(bits(v_cache), bits(v_ref))
    k_np, k_ref_np = np.asarray(k_cache, np.float32), np.asarray(k_ref, np.float32)
    same = np.isnan(k_ref_np) | (np.abs(k_np - k_ref_np) <= q_tol * scale)
    assert np.array_equal(np.isnan(k_np), np.isnan(k_ref_np)) and same.all()
    # The reference against the numpy loop.
    q_np, k_loop, v_loop = numpy_loop(case, num_heads, layer, with_norm)
    np.testing.assert_allclose(np.asarray(q_ref, np.float32), q_np, atol=q_tol * 4 * scale, rtol=0)
    np.testing.assert_allclose(k_ref_np, k_loop, atol=q_tol * 4 * scale, rtol=0)
    np.testing.assert_allclose(np.asarray(v_ref, np.float32), v_loop, atol=0, rtol=0)


@pytest.mark.parametrize("T", [1, 5, 19])  # below, at and past block_t's multiples
def test_kernel_matches_reference_and_a_loop(T):
    case, num_heads = make_case(T=T, seed=T)
    check(case, num_heads, layer=1)


def test_without_norm_and_with_partial_rotary():
    case, num_heads = make_case(T=7, rotary_dim=16, seed=3)
    check(case, num_heads, layer=0, with_norm=False)
    check(case, num_heads, layer=1, with_norm=True)


def test_stacked_norm_weights_read_at_their_row():
    """norm_layer: the kernel reads row `norm_layer` of stacked [L, D] q/k norm weights; the result is
    bit for bit the one with that row's [D] weights."""
    case, num_heads = make_case(T=6, seed=8)
    rng = np.random.default_rng(9)
    stacked = {n: jnp.asarray(rng.uniform(0.5, 1.5, (3, case[n].shape[0])).astype(np.float32)).at[2].set(case[n])
               for n in ("q_norm", "k_norm")}
    args = [case[n] for n in ("cos", "sin", "k_cache", "v_cache", "slot_mapping")]
    want = qk_norm_rope_kv_write(case["qkv"], case["q_norm"], case["k_norm"], *args, 1, num_heads=num_heads,
                                 eps=EPS, interpret=not on_gpu)
    got = jax.jit(lambda row: qk_norm_rope_kv_write(case["qkv"], stacked["q_norm"], stacked["k_norm"], *args, 1,
                                                   num_heads=num_heads, eps=EPS, norm_layer=row,
                                                   interpret=not on_gpu))(jnp.int32(2))
    ref = qk_norm_rope_kv_write_reference(case["qkv"], stacked["q_norm"], stacked["k_norm"], *args, 1,
                                          num_heads=num_heads, eps=EPS, norm_layer=2)
    for g, w, r in zip(got, want, ref):
        np.testing.assert_array_equal(bits(g), bits(w))
        np.testing.assert_allclose(np.nan_to_num(np.asarray(r)), np.nan_to_num(np.asarray(w)), atol=2e-5)
    with pytest.raises(ValueError, match="norm weights"):
        qk_norm_rope_kv_write(case["qkv"], case["q_norm"], case["k_norm"], *args, 1, num_heads=num_heads,
                              norm_layer=0)


def check_bfloat16(case, num_heads, layer):
    q, k_cache, v_cache = jitted(qk_norm_rope_kv_write, num_heads, True)(case, np.int32(layer))
    q_ref, k_ref, v_ref = jitted(qk_norm_rope_kv_write_reference, num_heads, True)(case, np.int32(layer))
    # Within two bf16 ulps of the head's largest value: the norm's sum may round the other way,
    # and so may each of the two rounded products the rotation combines.
    for got, want in ((q, q_ref), (k_cache, k_ref)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        ulps = 2.0 ** -6 * np.nan_to_num(np.abs(want), nan=0).max(axis=-1, keepdims=True)
        assert np.array_equal(np.isnan(got), np.isnan(want))
        assert (np.nan_to_num(np.abs(got - want), nan=0) <= ulps).all()
    np.testing.assert_array_equal(bits(v_cache), bits(v_ref))


def test_bfloat16_rounds_like_the_reference():
    case, num_heads = make_case(T=9, dtype=jnp.bfloat16, seed=4)
    check_bfloat16(case, num_heads, layer=0)


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu, reason="needs a GPU")
@pytest.mark.parametrize("T", [1, 8, 256, 2048])
def test_qwen3_sizes_on_gpu(T):
    """Qwen3-0.6B's heads (16 q, 8 KV of 128) in bfloat16, at decode and prefill bucket sizes."""
    case, num_heads = make_case(T=T, H=16, Hkv=8, D=128, L=3, NB=160, bs=16, n_pad=T // 8, dtype=jnp.bfloat16, seed=T)
    check_bfloat16(case, num_heads, layer=2)


def test_no_tokens_leaves_the_cache_alone():
    case, num_heads = make_case(T=3)
    empty = {name: (a[:0] if name in ("qkv", "cos", "sin", "slot_mapping") else a) for name, a in case.items()}
    q, k_cache, v_cache = qk_norm_rope_kv_write(empty["qkv"], empty["q_norm"], empty["k_norm"], empty["cos"],
                                                empty["sin"], empty["k_cache"], empty["v_cache"],
                                                empty["slot_mapping"], 0, num_heads=num_heads, interpret=True)
    assert q.shape == (0, num_heads, case["k_cache"].shape[-1])
    np.testing.assert_array_equal(bits(k_cache), bits(case["k_cache"]))
    np.testing.assert_array_equal(bits(v_cache), bits(case["v_cache"]))


def test_bad_shapes_are_named():
    case, num_heads = make_case(T=3)
    with pytest.raises(ValueError, match="qkv"):
        qk_norm_rope_kv_write(case["qkv"][:, :-1], case["q_norm"], case["k_norm"], case["cos"], case["sin"],
                              case["k_cache"], case["v_cache"], case["slot_mapping"], 0, num_heads=num_heads)
    with pytest.raises(ValueError, match="both or neither"):
        qk_norm_rope_kv_write(case["qkv"], case["q_norm"], None, case["cos"], case["sin"],
                              case["k_cache"], case["v_cache"], case["slot_mapping"], 0, num_heads=num_heads)


@pytest.mark.parametrize("tokens", [1, 256])
def test_it_lowers_to_triton_at_qwen3_shapes(triton_lowering_without_a_gpu, tokens):
    """Pallas's Triton lowering at Qwen3-0.6B's shapes, the norm weights stacked."""
    S, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    cache = S((28, 512, 8, 16, 128), bf16)
    args = (S((tokens, 4096), bf16), S((28, 128), bf16), S((28, 128), bf16), S((tokens, 64), jnp.float32),
            S((tokens, 64), jnp.float32), cache, cache, S((tokens,), i32), S((), i32), S((), i32))

    def write(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, layer, row):
        return qk_norm_rope_kv_write(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, layer, num_heads=16,
                                     norm_layer=row)

    jax.jit(write).trace(*args).lower(lowering_platforms=("cuda",))
