"""write_kv: Pallas kernel (interpret mode on CPU) vs the jnp reference vs a numpy loop.

The cache is poisoned with NaN and random values; afterwards every written slot must hold
the new K/V and every other slot (other layers, padding tokens' slots, unused offsets) must
keep its old bits exactly.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_write import write_kv, write_kv_reference

on_gpu = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not on_gpu, reason="needs a GPU")


def make_case(*, T, L=3, NB=10, H=2, bs=16, D=32, n_pad=3, dtype=jnp.float32, seed=0, new_dtype=None):
    rng = np.random.default_rng(seed)
    shape = (L, NB, H, bs, D)
    k = rng.standard_normal(shape).astype(np.float32)
    k.reshape(-1)[rng.random(k.size) < 0.1] = np.nan  # poison: must survive bit-exactly
    v = -k
    slots = rng.choice(NB * bs, size=T, replace=False).astype(np.int32)  # shuffled slots
    slots[rng.choice(T, size=min(n_pad, T), replace=False)] = -1
    k_new = rng.standard_normal((T, H, D)).astype(np.float32)
    v_new = rng.standard_normal((T, H, D)).astype(np.float32)
    nd = new_dtype or dtype
    return (
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(k_new, nd),
        jnp.asarray(v_new, nd),
        jnp.asarray(slots),
    )


def numpy_write(cache, new, slots, layer):
    new = np.asarray(new.astype(cache.dtype).astype(jnp.float32))  # rounded like the cache
    cache = np.array(cache.astype(jnp.float32))  # bf16 -> f32 is exact, NaNs kept
    bs = cache.shape[3]
    for t, s in enumerate(np.asarray(slots)):
        if s >= 0:
            cache[layer, s // bs, :, s % bs] = new[t]
    return cache


def bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


@functools.lru_cache(maxsize=None)
def kernel_fn(**kw):
    return jax.jit(functools.partial(write_kv, interpret=not on_gpu, **kw))


def check(case, layer, **kw):
    k, v, k_new, v_new, slots = case
    k_out, v_out = kernel_fn(**kw)(k, v, k_new, v_new, slots, jnp.int32(layer))
    k_ref, v_ref = jax.jit(write_kv_reference)(k, v, k_new, v_new, slots, jnp.int32(layer))
    # Kernel == reference bit for bit (NaN poison included) ...
    np.testing.assert_array_equal(bits(k_out), bits(k_ref))
    np.testing.assert_array_equal(bits(v_out), bits(v_ref))
    # ... and the reference == an independent numpy loop.
    np.testing.assert_array_equal(np.asarray(k_ref.astype(jnp.float32)), numpy_write(k, k_new, slots, layer))
    np.testing.assert_array_equal(np.asarray(v_ref.astype(jnp.float32)), numpy_write(v, v_new, slots, layer))
    return k_out, v_out


@pytest.mark.parametrize("T", [1, 16, 37])  # below, at and past a multiple of block_t
@pytest.mark.parametrize("layer", [0, 2])
def test_matches_reference_and_numpy(T, layer):
    check(make_case(T=T, seed=T + layer), layer)


@pytest.mark.parametrize("bs", [8, 32])
def test_other_block_sizes(bs):
    check(make_case(T=20, bs=bs, NB=6), 1)


def test_bf16_cache_with_f32_inputs():
    check(make_case(T=21, dtype=jnp.bfloat16, new_dtype=jnp.float32), 1)


def test_all_padding_writes_nothing():
    k, v, k_new, v_new, slots = make_case(T=8)
    k_out, v_out = check((k, v, k_new, v_new, jnp.full_like(slots, -1)), 1)
    np.testing.assert_array_equal(bits(k_out), bits(k))
    np.testing.assert_array_equal(bits(v_out), bits(v))


def test_small_block_t_and_many_heads():
    check(make_case(T=19, H=8, D=16, n_pad=5), 1, block_t=4)


def test_traced_layer_inside_scan_with_donation():
    # The model's use: lax.scan over layers carries the donated cache and writes each layer.
    k, v, _, _, slots = make_case(T=12)
    L = k.shape[0]
    rng = np.random.default_rng(1)
    k_new_all = jnp.asarray(rng.standard_normal((L, 12, 2, 32)), jnp.float32)
    v_new_all = k_new_all + 1

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(k_cache, v_cache):
        def body(caches, xs):
            layer, k_new, v_new = xs
            return write_kv(*caches, k_new, v_new, slots, layer, interpret=not on_gpu), None

        xs = (jnp.arange(L, dtype=jnp.int32), k_new_all, v_new_all)
        return jax.lax.scan(body, (k_cache, v_cache), xs)[0]

    want_k, want_v = np.asarray(k), np.asarray(v)
    for layer in range(L):
        want_k = numpy_write(jnp.asarray(want_k), k_new_all[layer], slots, layer)
        want_v = numpy_write(jnp.asarray(want_v), v_new_all[layer], slots, layer)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Some donated buffers were not usable")
        k_out, v_out = step(k, v)
    assert k.is_deleted() and v.is_deleted()  # the donation was accepted
    np.testing.assert_array_equal(bits(k_out), bits(want_k))
    np.testing.assert_array_equal(bits(v_out), bits(want_v))


def test_in_place_when_donated():
    k, v, k_new, v_new, slots = make_case(T=9)
    # Fresh device buffers: on the CPU, arrays made from numpy may alias numpy's memory, and
    # XLA cannot reuse a buffer it does not own.
    k, v = jnp.copy(k), jnp.copy(v)
    k_ptr, v_ptr = k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()
    f = jax.jit(functools.partial(write_kv, interpret=not on_gpu), donate_argnums=(0, 1))
    k_out, v_out = f(k, v, k_new, v_new, slots, jnp.int32(1))
    assert k_out.unsafe_buffer_pointer() == k_ptr and v_out.unsafe_buffer_pointer() == v_ptr


@pytest.mark.gpu
@gpu_only
def test_gpu_qwen3_shapes_in_place():
    # Qwen3-0.6B KV heads, bf16, a multi-GiB stacked cache; the update must not copy it.
    L, NB, H, bs, D, T = 28, 4096, 8, 16, 128, 4096
    k = jnp.zeros((L, NB, H, bs, D), jnp.bfloat16)
    v = jnp.ones((L, NB, H, bs, D), jnp.bfloat16)
    rng = np.random.default_rng(2)
    slots = rng.choice(NB * bs, size=T, replace=False).astype(np.int32)
    slots[-100:] = -1
    k_new = jnp.asarray(rng.standard_normal((T, H, D)), jnp.bfloat16)
    v_new = jnp.asarray(rng.standard_normal((T, H, D)), jnp.bfloat16)
    slots = jnp.asarray(slots)
    k_ref, v_ref = jax.jit(write_kv_reference)(k, v, k_new, v_new, slots, jnp.int32(27))
    k_ptr = k.unsafe_buffer_pointer()
    f = jax.jit(write_kv, donate_argnums=(0, 1))
    k_out, v_out = f(k, v, k_new, v_new, slots, jnp.int32(27))
    assert k_out.unsafe_buffer_pointer() == k_ptr  # written in place
    np.testing.assert_array_equal(bits(k_out[27]), bits(k_ref[27]))
    np.testing.assert_array_equal(bits(v_out[27]), bits(v_ref[27]))
    assert bool(jnp.all(k_out[:27] == 0)) and bool(jnp.all(v_out[:27] == 1))
