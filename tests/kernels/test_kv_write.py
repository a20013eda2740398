"""write_kv: Pallas kernel (interpret mode on CPU) vs the jnp reference vs a numpy loop; write_kv_mgpu
(the Mosaic GPU kernel, in Mosaic GPU's interpreter on CPU) vs the same reference.

The cache is poisoned with NaN and random values; afterwards every written slot must hold
the new K/V and every other slot (other layers, padding tokens' slots, unused offsets) must
keep its old bits exactly.
"""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_write import write_kv, write_kv_reference
from pallas_kernels.kv_write_mgpu import write_kv_mgpu

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
    # Converted on the host: jnp.asarray would compile a conversion per shape.
    return tuple(jax.device_put(x.astype(dt)) for x, dt in ((k, dtype), (v, dtype), (k_new, nd), (v_new, nd),
                                                             (slots, np.int32)))


def numpy_write(cache, new, slots, layer):
    new = np.asarray(new).astype(cache.dtype).astype(np.float32)  # rounded like the cache
    cache = np.asarray(cache).astype(np.float32)  # bf16 -> f32 is exact, NaNs kept
    bs = cache.shape[3]
    for t, s in enumerate(np.asarray(slots)):
        if s >= 0:
            cache[layer, s // bs, :, s % bs] = new[t]
    return cache


def bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


reference = jax.jit(write_kv_reference)


@functools.lru_cache(maxsize=None)
def kernel_fn(kernel=write_kv, **kw):
    return jax.jit(functools.partial(kernel, interpret=not on_gpu, **kw))


def check(case, layer, kernel=write_kv, **kw):
    """`kernel`'s result == the reference's, bit for bit, and the reference == a numpy loop."""
    k, v, k_new, v_new, slots = case
    k_out, v_out = kernel_fn(kernel, **kw)(k, v, k_new, v_new, slots, np.int32(layer))
    k_ref, v_ref = reference(k, v, k_new, v_new, slots, np.int32(layer))
    # Kernel == reference bit for bit (NaN poison included) ...
    np.testing.assert_array_equal(bits(k_out), bits(k_ref))
    np.testing.assert_array_equal(bits(v_out), bits(v_ref))
    # ... and the reference == an independent numpy loop.
    np.testing.assert_array_equal(np.asarray(k_ref).astype(np.float32), numpy_write(k, k_new, slots, layer))
    np.testing.assert_array_equal(np.asarray(v_ref).astype(np.float32), numpy_write(v, v_new, slots, layer))
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
    k_out, v_out = check((k, v, k_new, v_new, np.full(slots.shape, -1, np.int32)), 1)
    np.testing.assert_array_equal(bits(k_out), bits(k))
    np.testing.assert_array_equal(bits(v_out), bits(v))


def test_small_block_t_and_many_heads():
    check(make_case(T=19, H=8, D=16, n_pad=5), 1, block_t=4)


def test_traced_layer_inside_scan_with_donation():
    # The model's use: lax.scan over layers carries the donated cache and writes each layer.
    k, v, _, _, slots = make_case(T=12)
    L = k.shape[0]
    rng = np.random.default_rng(1)
    k_new_all = rng.standard_normal((L, 12, 2, 32)).astype(np.float32)
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
        want_k = numpy_write(want_k, k_new_all[layer], slots, layer)
        want_v = numpy_write(want_v, v_new_all[layer], slots, layer)
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
    k_out, v_out = f(k, v, k_new, v_new, slots, np.int32(1))
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


# ----------------------------------------------------------------------------------------
# The Mosaic GPU kernel (kv_write_mgpu.write_kv_mgpu): same contract, same reference. On the
# CPU it runs in Mosaic GPU's interpreter; its lowering needs num_kv_heads * head_dim to be a
# multiple of 128, hence head_dim 64 with 2 heads here.
# ----------------------------------------------------------------------------------------


def check_mgpu(case, layer, **kw):
    return check(case, layer, kernel=write_kv_mgpu, **kw)


@pytest.mark.parametrize("T, layer", [(1, 0), (4, 2), (9, 1)])  # below, at and past a multiple of block_t
def test_mgpu_matches_reference(T, layer):
    check_mgpu(make_case(T=T, D=64, n_pad=2, seed=T), layer, block_t=4)


def test_mgpu_bf16_cache_with_f32_inputs_and_block_t_1():
    check_mgpu(make_case(T=6, D=64, dtype=jnp.bfloat16, new_dtype=jnp.float32), 2, block_t=1)


def test_mgpu_many_heads_other_block_size():
    check_mgpu(make_case(T=7, H=8, D=16, bs=8, NB=6, n_pad=3), 1, block_t=4)


def test_mgpu_all_padding_writes_nothing():
    k, v, k_new, v_new, slots = make_case(T=4, D=64)
    k_out, v_out = check_mgpu((k, v, k_new, v_new, np.full(slots.shape, -1, np.int32)), 1, block_t=4)
    np.testing.assert_array_equal(bits(k_out), bits(k))
    np.testing.assert_array_equal(bits(v_out), bits(v))


def test_mgpu_refuses_heads_times_head_dim_not_a_multiple_of_128():
    k, v, k_new, v_new, slots = make_case(T=2, D=32)  # 2 * 32 = 64
    with pytest.raises(ValueError, match="multiple of 128"):
        write_kv_mgpu(k, v, k_new, v_new, slots, 0, interpret=True)


def test_mgpu_traced_layer_inside_scan_with_donation_in_place():
    # The model's use: lax.scan over layers carries the donated cache and writes each layer.
    k, v, _, _, slots = make_case(T=5, D=64, dtype=jnp.bfloat16)
    k, v = jnp.copy(k), jnp.copy(v)  # device-owned buffers (see test_in_place_when_donated)
    L = k.shape[0]
    rng = np.random.default_rng(3)
    k_new_all = rng.standard_normal((L, 5, 2, 64)).astype(np.float32)
    v_new_all = k_new_all + 1

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(k_cache, v_cache):
        def body(caches, xs):
            layer, k_new, v_new = xs
            return write_kv_mgpu(*caches, k_new, v_new, slots, layer, interpret=not on_gpu, block_t=4), None

        xs = (jnp.arange(L, dtype=jnp.int32), k_new_all, v_new_all)
        return jax.lax.scan(body, (k_cache, v_cache), xs)[0]

    want_k, want_v = k, v
    for layer in range(L):
        want_k, want_v = reference(want_k, want_v, k_new_all[layer], v_new_all[layer], slots, np.int32(layer))
    want_k, want_v = np.asarray(want_k), np.asarray(want_v)
    k_ptr, v_ptr = k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Some donated buffers were not usable")
        k_out, v_out = step(k, v)
    assert k.is_deleted() and v.is_deleted()  # the donation was accepted ...
    assert k_out.unsafe_buffer_pointer() == k_ptr and v_out.unsafe_buffer_pointer() == v_ptr  # ... and used
    np.testing.assert_array_equal(bits(k_out), bits(want_k))
    np.testing.assert_array_equal(bits(v_out), bits(want_v))


@pytest.mark.parametrize("new_dtype, block_t", [(jnp.bfloat16, 4), (jnp.float32, 1)])
def test_mgpu_lowers_for_cuda_aliasing_the_caches(new_dtype, block_t):
    # The real Mosaic GPU lowering (Pallas -> Mosaic GPU IR, layout inference, the casts) runs on
    # the CPU too: what interpret mode does not check, short of the GPU compiler itself.
    S = jax.ShapeDtypeStruct
    cache, new = S((28, 2048, 8, 16, 128), jnp.bfloat16), S((37, 8, 128), new_dtype)
    f = jax.jit(functools.partial(write_kv_mgpu, block_t=block_t), donate_argnums=(0, 1))
    hlo = f.trace(cache, cache, new, new, S((37,), jnp.int32), S((), jnp.int32))
    hlo = hlo.lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @mosaic_gpu" in hlo and "stablehlo.copy" not in hlo
    aliases = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d)\], operand_index = (\d)", hlo)
    assert sorted(aliases) == [("0", "4"), ("1", "5")]  # both caches are the kernel's outputs


def gpu_case(T, L=28, NB=2048, H=8, bs=16, D=128, seed=4):
    rng = np.random.default_rng(seed)
    slots = rng.choice(NB * bs, size=T, replace=False).astype(np.int32)
    slots[rng.choice(T, size=T // 16, replace=False)] = -1
    keys = jax.random.split(jax.random.key(seed), 2)
    k_new = jax.random.normal(keys[0], (T, H, D), jnp.float32).astype(jnp.bfloat16)
    v_new = jax.random.normal(keys[1], (T, H, D), jnp.float32).astype(jnp.bfloat16)
    return (L, NB, H, bs, D), k_new, v_new, jnp.asarray(slots)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("T", [256, 8192])
def test_gpu_mgpu_realistic_shapes_in_place(T):
    # Qwen3-0.6B's KV heads, bf16, 28 layers x 2048 blocks (~1.9 GB per cache), compiled Mosaic
    # GPU kernel; the donated update must write into the caches' own buffers.
    shape, k_new, v_new, slots = gpu_case(T)
    layer = jnp.int32(shape[0] - 2)
    k = jnp.zeros(shape, jnp.bfloat16)
    v = jnp.full(shape, 2.0, jnp.bfloat16)
    k_ref, v_ref = jax.jit(write_kv_reference)(k, v, k_new, v_new, slots, layer)
    f = jax.jit(write_kv_mgpu, donate_argnums=(0, 1)).lower(k, v, k_new, v_new, slots, layer).compile()
    assert f.memory_analysis().temp_size_in_bytes < k.nbytes // 100  # no copy of a cache inside
    k_ptr, v_ptr = k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()
    k_out, v_out = f(k, v, k_new, v_new, slots, layer)
    assert k_out.unsafe_buffer_pointer() == k_ptr and v_out.unsafe_buffer_pointer() == v_ptr  # in place
    # Every element (all layers) equals the reference's; compared on the device.
    assert bool(jnp.array_equal(k_out, k_ref)) and bool(jnp.array_equal(v_out, v_ref))
    assert int(jnp.sum(k_out[layer] != 0)) > 0  # the written rows are really there
