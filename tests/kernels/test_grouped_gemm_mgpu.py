"""grouped_gemm_mgpu (the MoE grouped GEMM on Mosaic GPU): its row-tile schedule against a numpy
check; the kernel in Mosaic GPU's interpreter on the CPU against grouped_gemm_reference (decode-like
groups, a group over several row tiles, the zero tail, no rows at all); its default configs at
Qwen3-30B-A3B's shapes lowered for CUDA (the interpreter runs tilings the real lowering refuses); bad
input refused; on a GPU (`-m gpu`) the real kernel against the reference at the real shapes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.moe import quantize_fp8
from pallas_kernels import grouped_gemm_mgpu as gm
from pallas_kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference
from pallas_kernels.grouped_gemm_mgpu import GroupedConfig, default_config, grouped_gemm_mgpu

on_gpu = jax.default_backend() == "gpu"
# Qwen3-30B-A3B's routed GEMMs, [K, N]: gate_up (gate and up fused) and down; 128 experts, top-8.
EXPERTS, TOP_K = 128, 8
QWEN3_30B = {"gate_up": (2048, 1536), "down": (768, 2048)}


def make(sizes, k, n, extra=0, seed=0, fp8=False):
    """bf16 operands for groups of `sizes` rows and `extra` rows past them; with `fp8` the weights
    quantised to float8_e4m3fn with 128 x 128 block scales (the benchmark's quantiser), the
    scales last."""
    rng = np.random.default_rng(seed)
    m = int(sum(sizes)) + extra
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(0.05 * rng.standard_normal((len(sizes), k, n)), jnp.bfloat16)
    if fp8:
        return lhs, *jax.jit(quantize_fp8)(rhs), jnp.asarray(sizes, jnp.int32)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


@functools.lru_cache(maxsize=None)
def jitted(config):
    return jax.jit(functools.partial(grouped_gemm_mgpu, config=config, interpret=not on_gpu))


def check(lhs, rhs, group_sizes, config, reference=grouped_gemm_reference, rhs_scale=None):
    """The kernel == the reference to a bf16 rounding step (both round an f32 sum once, summed in
    another order; FP8 weights dequantised the same way); rows past the groups are exactly zero."""
    out = np.asarray(jitted(config)(lhs, rhs, group_sizes, rhs_scale), np.float32)
    ref = np.asarray(jax.jit(reference)(lhs, rhs, group_sizes, rhs_scale), np.float32)
    assert out.shape == (lhs.shape[0], rhs.shape[2])
    np.testing.assert_allclose(out, ref, rtol=2**-7, atol=1e-2)
    total = min(int(np.maximum(np.asarray(group_sizes), 0).sum()), lhs.shape[0])
    assert not out[total:].any()


# --- the schedule ------------------------------------------------------------------------------

@pytest.mark.parametrize("row_tile", [8, 16, 32, 64])
def test_schedule_covers_every_row_once(row_tile):
    """For random group sizes (empty groups, groups over several tiles, sizes past M, negative
    sizes): the tiles' stored rows cover [0, M) exactly once, each inside its group (the zero tail
    as group G), every tile reads an 8-aligned window inside the padded rows, and the tiles fit the
    static bound."""
    rng = np.random.default_rng(row_tile)
    schedule = jax.jit(gm.tile_schedule, static_argnums=(1, 2))
    g = 9
    for trial in range(40):
        m = 5 if trial % 4 == 0 else 4 * row_tile + 3  # fewer rows than a tile; M not a multiple of 8
        sizes = rng.integers(-2, 2 * m // g + 2 * row_tile // 3, g) * (rng.random(g) < 0.7)
        tiles = gm.num_tiles(m, g, row_tile)
        group, base, lo, count = np.asarray(schedule(jnp.asarray(sizes, jnp.int32), m, row_tile)).reshape(4, tiles)
        ends = np.minimum(np.cumsum(np.maximum(sizes, 0)), m)
        owner = np.searchsorted(ends, np.arange(m), side="right")  # g for the tail
        m8 = max(-(-m // 8) * 8, row_tile)
        seen = np.zeros(m, int)
        for t in np.flatnonzero(group >= 0):
            assert base[t] % 8 == 0 and 0 <= base[t] <= m8 - row_tile, (trial, t)
            assert 0 <= lo[t] and count[t] > 0 and lo[t] + count[t] <= row_tile, (trial, t)
            rows = np.arange(base[t] + lo[t], base[t] + lo[t] + count[t])
            assert (owner[rows] == group[t]).all(), (trial, t)
            seen[rows] += 1
        assert (seen == 1).all(), trial
        assert (group[group < 0] == -1).all() and not count[group < 0].any()


# --- the interpreter against the reference ------------------------------------------------------

# (sizes, K, N, extra rows, config): decode-like groups of 1-5 rows with empty ones at the default
# config and at 8-row tiles (groups straddle tiles); a group over several 16-row tiles and one
# straddling two 8-row blocks, 3 stages of 64-wide tiles; rows past the groups (M not a multiple of
# 8, so lhs is padded); every group empty; fewer rows than one tile.
CASES = {
    "decode": ((3, 0, 5, 1, 0, 2, 4, 0), 128, 128, 0, None),
    "decode_rt8": ((3, 0, 5, 1, 0, 2, 4, 0), 128, 128, 0, GroupedConfig(64, 64, 8, 2)),
    "big_group": ((40, 3, 0, 21), 256, 128, 0, GroupedConfig(64, 64, 16, 3)),
    "zero_tail": ((3, 4, 0, 6), 128, 256, 5, GroupedConfig(128, 32, 8, 2)),
    "all_empty": ((0, 0, 0), 64, 64, 5, None),
    "few_rows": ((2, 0, 1), 128, 64, 0, GroupedConfig(64, 64, 32, 2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_kernel_matches_reference(case):
    sizes, k, n, extra, config = CASES[case]
    check(*make(sizes, k, n, extra), config)


# FP8 weights (two scale blocks along K and N): decode-like groups with 64-wide tiles (two per
# scale block), a group over several row tiles with 128-wide ones and a single stage.
FP8_CASES = {
    "decode": ((3, 0, 5, 1, 0, 2, 4, 0), GroupedConfig(64, 64, 16, 3)),
    "big_group": ((40, 3, 0, 21), GroupedConfig(128, 64, 16, 1)),
}


@pytest.mark.parametrize("case", list(FP8_CASES))
def test_interpreted_kernel_with_fp8_weights_matches_reference(case):
    sizes, config = FP8_CASES[case]
    lhs, w8, scale, gs = make(sizes, 256, 256, extra=3, fp8=True)
    check(lhs, w8, gs, config, rhs_scale=scale)


def test_interpreter_finds_no_race_in_the_pipeline():
    """Mosaic GPU's interpreter with its race detector: the TMA ring (4 steps through 3 stages),
    the ladder of row stores and the zero tail race with nothing. (It runs wgmma synchronously, so
    it cannot see a stage refilled while a wgmma still reads it: wgmma_wait(1) guards that.)"""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # the detector's state is private

    lhs, rhs, gs = make((7, 0, 19, 2), 256, 64, extra=3)
    params = plgpu.InterpretGPUParams(detect_races=True)
    out = jax.block_until_ready(jax.jit(functools.partial(grouped_gemm_mgpu, config=GroupedConfig(64, 64, 16, 3),
                                                          interpret=params))(lhs, rhs, gs))
    assert not gpu_callbacks.get_races().races_found
    ref = jax.jit(grouped_gemm_reference)(lhs, rhs, gs)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=2**-7, atol=1e-2)


def test_empty_operands():
    lhs, rhs, gs = make((0, 0), 64, 64)
    assert grouped_gemm_mgpu(lhs, rhs, gs, interpret=True).shape == (0, 64)


# --- the default configs and the CUDA lowering ---------------------------------------------------

def test_default_config_rule_at_small_shapes():
    """Row tiles from about twice the mean group plus the alignment slack; 64-wide output tiles
    when few groups can have rows; tile_k the largest of 64, 32, 16 that divides K."""
    assert default_config(8, 128, 128, 8, num_sms=132) == GroupedConfig(64, 64, 16, 2)
    assert default_config(64, 96, 256, 8, num_sms=1) == GroupedConfig(128, 32, 32, 3)
    assert default_config(4096, 2048, 1536, 8, num_sms=132) == GroupedConfig(64, 64, 64, 3)


# The default configs at Qwen3-30B-A3B's shapes on 132 SMs, by tokens (rows = 8 per token):
# (tile_n, row_tile, max_concurrent_steps) and the grid's CTAs (those of real row tiles are at
# least 128 experts x N / tile_n when every expert gets a row: 1536 for gate_up, 2048 for down).
EXPECTED = {(1, "gate_up"): (64, 8, 4, 360), (1, "down"): (64, 8, 4, 480),
            (128, "gate_up"): (128, 32, 4, 2220), (128, "down"): (128, 32, 4, 2960),
            (256, "gate_up"): (128, 64, 3, 2076), (256, "down"): (128, 64, 3, 2768),
            (4096, "gate_up"): (128, 64, 3, 7836), (4096, "down"): (128, 64, 3, 10448)}


@pytest.mark.parametrize("tokens", [1, 128, 256, 4096])
def test_default_configs_at_qwen3_30b_shapes(tokens):
    m = tokens * TOP_K
    for name, (k, n) in QWEN3_30B.items():
        c = default_config(m, k, n, EXPERTS, num_sms=132)
        ctas = n // c.tile_n * gm.num_tiles(m, EXPERTS, c.row_tile)
        assert (c.tile_n, c.row_tile, c.max_concurrent_steps, ctas) == EXPECTED[tokens, name], name
        assert c.tile_k == 64


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
@pytest.mark.parametrize("tokens", [1, 128, 256, 4096])
def test_cuda_lowering_accepts_default_configs_at_qwen3_30b_shapes(tokens, weights, monkeypatch):
    """The real Mosaic GPU lowering (layouts, swizzles, wgmma shapes, TMA offsets, shared memory
    size) takes the default config of both GEMMs, lowered for CUDA on any backend with the H200's
    SM count: 128 tokens (the decode step of issue 27), 256 and a 4096-token prefill chunk; bf16
    and FP8 block-scaled weights."""
    monkeypatch.setattr(gm, "device_sm_count", lambda: 132)
    m = tokens * TOP_K
    sds = jax.ShapeDtypeStruct
    for k, n in QWEN3_30B.values():
        args = [sds((m, k), jnp.bfloat16), sds((EXPERTS, k, n), jnp.bfloat16), sds((EXPERTS,), jnp.int32)]
        if weights == "fp8":
            args[1] = sds((EXPERTS, k, n), jnp.float8_e4m3fn)
            args.append(sds((EXPERTS, k // 128, n // 128), jnp.float32))
        jax.jit(grouped_gemm_mgpu).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("tokens", [1, 256, 4096])
def test_cuda_lowering_accepts_default_configs_at_glm_45_air_fp8_shapes(tokens, monkeypatch):
    """GLM-4.5-Air's experts (hidden 4096, intermediate 1408, 128 experts, top 8, FP8 weights in
    128 x 128 blocks) lower for CUDA too: the preset the engine's default MoE backend runs it with."""
    monkeypatch.setattr(gm, "device_sm_count", lambda: 132)
    sds = jax.ShapeDtypeStruct
    for k, n in ((4096, 2 * 1408), (1408, 4096)):
        args = [sds((tokens * 8, k), jnp.bfloat16), sds((128, k, n), jnp.float8_e4m3fn), sds((128,), jnp.int32),
                sds((128, k // 128, n // 128), jnp.float32)]
        jax.jit(grouped_gemm_mgpu).trace(*args).lower(lowering_platforms=("cuda",))


def test_cuda_lowering_refuses_too_much_shared_memory():
    """Lowering checks the stages fit in shared memory (so the test above checks that too)."""
    args = (jax.ShapeDtypeStruct((64, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((8, 2048, 1024), jnp.bfloat16),
            jax.ShapeDtypeStruct((8,), jnp.int32))
    config = GroupedConfig(tile_n=256, tile_k=256, row_tile=256, max_concurrent_steps=4)
    with pytest.raises(ValueError, match="shared memory"):
        jax.jit(functools.partial(grouped_gemm_mgpu, config=config)).trace(*args).lower(lowering_platforms=("cuda",))


# --- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("lhs", "rhs", "gs", "dtypes", "config", "match"), [
    ((8, 64), (2, 64, 64), (2,), ("bfloat16", "float32", "int32"), None, "got lhs bfloat16 and rhs float32"),
    ((8, 64), (2, 64, 64), (2,), ("float16", "bfloat16", "int32"), None, "must be bfloat16, got lhs float16"),
    ((8, 64), (2, 64, 64), (2,), ("bfloat16", "float8_e4m3fn", "int32"), None, "FP8 weights need rhs_scale"),
    ((8, 64), (2, 64, 64), (2,), ("bfloat16", "bfloat16", "float32"), None, "group_sizes must be integers"),
    ((8, 64), (64, 64), (2,), None, None, "rhs \\[G, K, N\\]"),
    ((8, 64), (2, 128, 64), (2,), None, None, "lhs's K = 64 differs from rhs's K = 128"),
    ((8, 64), (2, 64, 64), (3,), None, None, "group_sizes must have shape \\(2,\\)"),
    ((8, 100), (2, 100, 64), (2,), None, None, "K = 100 is not divisible by tile_k = 64"),
    ((8, 64), (2, 64, 96), (2,), None, None, "N = 96 is not divisible by tile_n = 64"),
    ((8, 64), (2, 64, 64), (2,), None, GroupedConfig(32, 64, 8, 2), "tile_n = 32 must be a positive multiple of 64"),
    ((8, 64), (2, 64, 64), (2,), None, GroupedConfig(64, 8, 8, 2), "tile_k = 8 must be a positive multiple of 16"),
    ((8, 64), (2, 64, 64), (2,), None, GroupedConfig(64, 64, 12, 2), "row_tile = 12 must be a multiple of 8"),
    ((8, 64), (2, 64, 64), (2,), None, GroupedConfig(64, 64, 8, 0), "max_concurrent_steps = 0"),
])
def test_bad_input_raises(lhs, rhs, gs, dtypes, config, match):
    ld, rd, gd = dtypes or ("bfloat16", "bfloat16", "int32")
    with pytest.raises(ValueError, match=match):
        grouped_gemm_mgpu(np.zeros(lhs, jnp.dtype(ld)), np.zeros(rhs, jnp.dtype(rd)), np.zeros(gs, gd), config=config,
                          interpret=True)


@pytest.mark.parametrize(("rhs_dtype", "k", "scale_shape", "config", "match"), [
    ("bfloat16", 128, (2, 1, 1), None, "with rhs_scale, lhs must be bfloat16 and rhs float8_e4m3fn"),
    ("float8_e4m3fn", 128, (2, 1, 2), None, "rhs_scale has shape \\(2, 1, 2\\), expected \\(2, 1, 1\\)"),
    ("float8_e4m3fn", 256, (2, 2, 1), GroupedConfig(64, 256, 8, 2), "must divide scale_block = 128"),
])
def test_bad_fp8_input_raises(rhs_dtype, k, scale_shape, config, match):
    with pytest.raises(ValueError, match=match):
        grouped_gemm_mgpu(np.zeros((8, k), jnp.bfloat16), np.zeros((2, k, 128), jnp.dtype(rhs_dtype)),
                          np.zeros((2,), np.int32), np.ones(scale_shape, np.float32), config=config, interpret=True)


# --- on the GPU ----------------------------------------------------------------------------------

def routed_sizes(tokens, seed=0, skew=0.0):
    """Group sizes of `tokens` x top-8 over 128 experts from random logits (`skew` > 0 favours
    low expert ids, as a popular expert does)."""
    logits = jax.random.normal(jax.random.key(seed), (tokens, EXPERTS)) - skew * jnp.arange(EXPERTS) / EXPERTS
    ids = jax.lax.top_k(logits, TOP_K)[1].reshape(-1)
    return jnp.zeros((EXPERTS,), jnp.int32).at[ids].add(1)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 128, 256])
@pytest.mark.parametrize("skew", [0.0, 8.0])
def test_gpu_qwen3_30b_shapes_match_reference(tokens, skew):
    """The real kernel on the GPU, default configs, both GEMMs, routing from random logits (with
    skew, the first experts get several row tiles)."""
    sizes = routed_sizes(tokens, seed=tokens, skew=skew)
    for k, n in QWEN3_30B.values():
        lhs, rhs, _ = make([0] * EXPERTS, k, n, extra=tokens * TOP_K, seed=k)
        check(lhs, rhs, sizes, None)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [128, 256])
def test_gpu_fp8_weights_match_reference(tokens):
    """FP8 block-scaled weights, the real kernel at decode against the reference (which dequantises
    them first)."""
    sizes = routed_sizes(tokens, seed=tokens)
    for k, n in QWEN3_30B.values():
        lhs, w8, scale, _ = make([0] * EXPERTS, k, n, extra=tokens * TOP_K, seed=k, fp8=True)
        check(lhs, w8, sizes, None, rhs_scale=scale)


@pytest.mark.gpu
def test_gpu_prefill_chunk_matches_triton_kernel():
    """A 4096-token chunk (32768 rows, ~256 per expert: several row tiles each) against the Triton
    kernel (ragged_dot's dense expansion would need G x the output's memory), with rows past the
    groups."""
    sizes = routed_sizes(4096, seed=1).at[:4].set(0)
    for k, n in QWEN3_30B.values():
        lhs, rhs, _ = make([0] * EXPERTS, k, n, extra=4096 * TOP_K, seed=k)
        check(lhs, rhs, sizes, None, reference=grouped_gemm)
