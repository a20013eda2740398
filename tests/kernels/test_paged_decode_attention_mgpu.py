"""paged_decode_attention_mgpu (decode attention over the paged cache on Mosaic GPU): in Mosaic GPU's
interpreter on the CPU against ragged_paged_attention_reference (one token per row) on small batches
whose caches hold NaN everywhere a row may not read (past seq_len, unused block-table entries, the
other layer); its default configs at Qwen3-0.6B's decode shapes lowered for CUDA; bad input refused;
on a GPU (`-m gpu`) the real kernel against the reference at those shapes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_decode_attention_mgpu as pd
from pallas_kernels.paged_decode_attention_mgpu import DecodeConfig, default_config, paged_decode_attention_mgpu
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

on_gpu = jax.default_backend() == "gpu"
# Qwen3-0.6B's attention: 16 query heads, 8 KV heads, head_dim 128, block size 16.
HQ, HKV, D, BS = 16, 8, 128, 16


@functools.partial(jax.jit, static_argnames=("shape", "q_shape"))
def random_qkv(seed, dead, poison, *, shape, q_shape):
    """Random bf16 q and caches, the caches' `dead` slots (unless None) set to `poison`."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in (kk, kv))
    if dead is not None:
        k, v = (jnp.where(dead, poison.astype(jnp.bfloat16), x) for x in (k, v))
    return jax.random.normal(kq, q_shape, jnp.bfloat16), k, v


def make_batch(seq_lens, *, rows=None, hq, hkv, d, bs, max_blocks, num_layers=2, layer=1, seed=0,
               poison=np.nan):
    """A decode batch: ``seq_lens`` real rows (then padding rows up to ``rows``) on shuffled pages;
    with ``poison``, every cache slot no row may read holds it (the other layer's too)."""
    rows = rows or len(seq_lens)
    rng = np.random.default_rng(seed)
    num_blocks = rows * max_blocks + 3
    block_tables = np.zeros((rows, max_blocks), np.int32)  # unused entries: block 0
    lens = np.zeros(rows, np.int32)
    live = np.zeros((num_blocks * bs,), bool)
    free = rng.permutation(num_blocks)
    for i, n in enumerate(seq_lens):
        blocks, free = free[:-(-n // bs)], free[-(-n // bs):]
        block_tables[i, :len(blocks)] = blocks
        lens[i] = n
        slots = blocks[np.arange(n) // bs] * bs + np.arange(n) % bs
        live[slots] = True
    dead = None
    if poison is not None:
        dead = (np.arange(num_layers) != layer)[:, None, None, None, None] | ~live.reshape(num_blocks, bs)[
            None, :, None, :, None]
    q, k, v = random_qkv(seed, dead, np.float32(0 if poison is None else poison),
                         shape=(num_layers, num_blocks, hkv, bs, d), q_shape=(rows, hq, d))
    # device_put, not jnp.asarray (which compiles a program per shape).
    return dict(q=q, k_cache=k, v_cache=v, block_tables=jax.device_put(block_tables), seq_lens=jax.device_put(lens),
                num_seqs=jax.device_put(np.int32(len(seq_lens))), layer=jax.device_put(np.int32(layer)))


@functools.lru_cache(maxsize=None)
def kernel_fn(config, sm_scale):
    return jax.jit(functools.partial(paged_decode_attention_mgpu, sm_scale=sm_scale, config=config,
                                     interpret=not on_gpu))


@functools.lru_cache(maxsize=None)
def reference_fn(sm_scale):
    def ref(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, *, layer):
        qsl = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
        return ragged_paged_attention_reference(q, k_cache, v_cache, layer, block_tables, seq_lens, qsl, num_seqs,
                                                sm_scale=sm_scale)

    return jax.jit(ref)


def check(batch, config, *, sm_scale=None):
    """The kernel == the reference within bf16 rounding (P is rounded to bf16 before P V, and the
    output to bf16); padding rows exactly 0; no NaN anywhere."""
    sm_scale = sm_scale or batch["q"].shape[-1] ** -0.5
    out = np.asarray(kernel_fn(config, sm_scale)(**batch), np.float32)
    ref = np.asarray(reference_fn(sm_scale)(**batch), np.float32)
    assert out.shape == batch["q"].shape
    assert not np.isnan(out).any(), f"NaN in rows {np.where(np.isnan(out).any((1, 2)))[0]}"
    n = int(batch["num_seqs"])
    np.testing.assert_array_equal(out[n:], 0.0)
    # Relative to the largest output: a long context averages the values down to ~1/sqrt(seq_len).
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err <= 1e-2, f"max error {err:.2e} of the largest output"
    return out


# (seq_lens, rows, Hq, Hkv, block_size, max_blocks, config). Lengths off the page size and off the
# 64-token tile, a row of length 1, padding rows; 1 split and several (with empty splits for short
# rows); a single-stage ring; pages of 32 and of 128 tokens (a tile inside a page).
CASES = {
    "g2_nosplit": ([100, 1, 37], 5, 4, 2, 16, 10, DecodeConfig(num_splits=1, max_concurrent_steps=2)),
    "g2_split3": ([150, 1, 64, 129], 4, 4, 2, 16, 10, DecodeConfig(num_splits=3, max_concurrent_steps=2)),
    "g4_split2_bs32": ([200, 5, 1], 4, 8, 2, 32, 7, DecodeConfig(num_splits=2, max_concurrent_steps=3)),
    "g4_one_stage_bs128": ([130, 1], 3, 8, 2, 128, 2, DecodeConfig(num_splits=1, max_concurrent_steps=1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_kernel_matches_reference(case):
    lens, rows, hq, hkv, bs, max_blocks, config = CASES[case]
    batch = make_batch(lens, rows=rows, hq=hq, hkv=hkv, d=64, bs=bs, max_blocks=max_blocks)
    check(batch, config)


def test_fused_decode_attention_through_the_decode_kernel_matches_the_reference_path():
    """PagedAttention as fused decode builds it (`one_token_rows`, `decode_kernel="mgpu"`): rows 0
    and 2 decode one token, row 1 is paused (no token this step), row 3 is padding; the KV write and
    the attention equal the jnp reference path's, the padding tokens' outputs are 0."""
    from mrv2_jax.models.attention import PagedAttention

    batch = make_batch([37, 20, 70], rows=4, hq=4, hkv=2, d=64, bs=16, max_blocks=6, poison=None)
    q_rows, bt, lens = batch["q"], batch["block_tables"], np.asarray(batch["seq_lens"])
    q = np.concatenate([np.asarray(q_rows)[[0, 2]], np.zeros((2, 4, 64), jnp.bfloat16)])  # tokens, padded to 4
    k_new, v_new = (jax.random.normal(jax.random.key(s), (4, 2, 64), jnp.bfloat16) for s in (7, 8))
    table = np.asarray(bt)
    slots = [table[r, (lens[r] - 1) // 16] * 16 + (lens[r] - 1) % 16 for r in (0, 2)]
    meta = dict(slot_mapping=np.array(slots + [-1, -1], np.int32), block_tables=bt, seq_lens=batch["seq_lens"],
                query_start_loc=np.array([0, 1, 1, 2, 2], np.int32), num_seqs=batch["num_seqs"])
    cache = (batch["k_cache"], batch["v_cache"])

    @functools.partial(jax.jit, static_argnames="options")
    def attend(meta, q, k_new, v_new, layer, cache, options):
        return PagedAttention(**meta, **dict(options))(q, k_new, v_new, layer, cache, 0.125)

    want, want_cache = attend(meta, q, k_new, v_new, batch["layer"], cache, options=(("use_kernels", False),))
    got, got_cache = attend(meta, q, k_new, v_new, batch["layer"], cache,
                            options=(("use_kernels", True), ("interpret", not on_gpu), ("one_token_rows", True),
                                     ("decode_kernel", "mgpu")))
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_array_equal(got[2:], 0.0)
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-2
    for g, w in zip(got_cache, want_cache):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_interpreted_kernel_g8_head_dim_128_default_config():
    """G = 8 (no padding head), head_dim 128, the default rule's split, all rows real."""
    batch = make_batch([70, 256, 3], hq=16, hkv=2, d=128, bs=16, max_blocks=16, seed=3)
    check(batch, None)


def test_interpreter_finds_no_race_in_the_ring():
    """Mosaic GPU's interpreter with its race detector: 5 tiles through a ring of 2 stages, the dead
    values zeroed in a stage, P's tile rewritten every step and the partials' stores race with nothing.
    (It runs wgmma synchronously: wgmma_wait(0) before a stage's refill guards the real one.)"""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # the detector's state is private
    from jax.experimental.pallas import mosaic_gpu as plgpu

    batch = make_batch([300, 20], rows=3, hq=4, hkv=2, d=64, bs=16, max_blocks=19, seed=5)
    params = plgpu.InterpretGPUParams(detect_races=True)
    out = jax.jit(functools.partial(paged_decode_attention_mgpu, sm_scale=0.125, config=DecodeConfig(1, 2),
                                    interpret=params))(**batch)
    assert not gpu_callbacks.get_races().races_found
    ref = reference_fn(0.125)(**batch)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.abs(out - ref).max() <= 1e-2 * np.abs(ref).max()


def test_default_config_rule():
    """At least 4 CTAs per SM where the context allows it, >= 4 tiles per split."""
    assert default_config(256, 8, 4096, num_sms=132) == DecodeConfig(num_splits=1, max_concurrent_steps=3)
    assert default_config(32, 8, 4096, num_sms=132) == DecodeConfig(num_splits=4, max_concurrent_steps=3)
    assert default_config(1, 8, 4096, num_sms=132).num_splits == 16  # 64 tiles: 4 each
    assert default_config(1, 8, 512, num_sms=132).num_splits == 2  # 8 tiles: 4 each
    assert default_config(1, 8, 32768, num_sms=132).num_splits == 128  # 1024 CTAs
    assert default_config(4, 8, 100, num_sms=132).num_splits == 1  # 2 tiles


def decode_shapes(rows, ctx=4096):
    num_blocks = rows * ctx // BS + 1
    s = jax.ShapeDtypeStruct
    cache = s((2, num_blocks, HKV, BS, D), jnp.bfloat16)
    return (s((rows, HQ, D), jnp.bfloat16), cache, cache, s((rows, ctx // BS), jnp.int32), s((rows,), jnp.int32),
            s((), jnp.int32))


@pytest.mark.parametrize(("rows", "ctas"), [(256, 2048), (32, 1024)])
def test_cuda_lowering_accepts_default_configs_at_qwen3_decode_shapes(rows, ctas, monkeypatch):
    """The real Mosaic GPU lowering (layouts, swizzles, wgmma shapes, TMA, shared memory) takes the
    default config at 256 and 32 rows of 4K context, with the H200's SM count."""
    monkeypatch.setattr(pd, "device_sm_count", lambda: 132)
    config = default_config(rows, HKV, 4096)
    assert rows * HKV * config.num_splits == ctas
    f = jax.jit(functools.partial(paged_decode_attention_mgpu, sm_scale=D**-0.5))
    f.trace(*decode_shapes(rows), layer=jnp.int32(1)).lower(lowering_platforms=("cuda",))


def test_cuda_lowering_refuses_too_much_shared_memory():
    """Lowering checks the ring fits in shared memory (so the test above checks that too)."""
    f = jax.jit(functools.partial(paged_decode_attention_mgpu, sm_scale=D**-0.5,
                                  config=DecodeConfig(num_splits=1, max_concurrent_steps=8)))
    with pytest.raises(ValueError, match="shared memory"):
        f.trace(*decode_shapes(32), layer=jnp.int32(1)).lower(lowering_platforms=("cuda",))


def _bad(q=(4, 4, 64), cache=(2, 8, 2, 16, 64), bt=(4, 3), lens=(4,), dtypes=None, v_cache=None):
    qd, kd = dtypes or (jnp.bfloat16, jnp.bfloat16)
    return (np.zeros(q, qd), np.zeros(cache, kd), np.zeros(v_cache or cache, kd), np.zeros(bt, np.int32),
            np.zeros(lens, np.int32), np.int32(1))


@pytest.mark.parametrize(("args", "config", "match"), [
    (_bad(q=(4, 1, 4, 64)), None, "q must be \\[R, Hq, D\\]"),
    (_bad(v_cache=(2, 8, 2, 32, 64)), None, "k_cache and v_cache must both be"),
    (_bad(q=(4, 4, 128)), None, "q's head_dim = 128 differs from the cache's 64"),
    (_bad(q=(4, 3, 64)), None, "Hq = 3 query heads is not a multiple of Hkv = 2"),
    (_bad(q=(4, 18, 64)), None, "G = Hq / Hkv = 9 query heads per KV head"),
    (_bad(dtypes=(jnp.float32, jnp.bfloat16)), None, "must be bfloat16, got q float32"),
    (_bad(q=(4, 4, 32), cache=(2, 8, 2, 16, 32)), None, "head_dim = 32 must be a multiple of 64"),
    (_bad(cache=(2, 8, 2, 12, 64)), None, "block_size = 12 must be a multiple of 8"),
    (_bad(cache=(2, 8, 2, 96, 64)), None, "block_size = 96"),
    (_bad(bt=(3, 3)), None, "block_tables must be \\[R = 4, max_blocks\\]"),
    (_bad(lens=(5,)), None, "seq_lens must be \\[R = 4\\]"),
    (_bad(), DecodeConfig(num_splits=0), "num_splits = 0 must be positive"),
    (_bad(), DecodeConfig(max_concurrent_steps=0), "max_concurrent_steps = 0 must be positive"),
])
def test_bad_input_raises(args, config, match):
    with pytest.raises(ValueError, match=match):
        paged_decode_attention_mgpu(*args, layer=0, sm_scale=0.125, config=config, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [256, 32])
def test_gpu_qwen3_decode_shapes_match_reference(rows):
    """The real kernel, default config, 4K-token rows (one shorter, one of length 1, two padding
    rows) against the reference."""
    lens = [4096] * (rows - 4) + [4000, 1]
    batch = make_batch(lens, rows=rows, hq=HQ, hkv=HKV, d=D, bs=BS, max_blocks=4096 // BS, seed=rows)
    check(batch, None)
