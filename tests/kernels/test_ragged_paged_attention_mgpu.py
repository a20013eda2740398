"""ragged_paged_attention_mgpu (mixed prefill/decode attention over the paged cache on Mosaic GPU): its
tile schedule against a plain loop over the rows; the kernel in Mosaic GPU's interpreter on the CPU
against ragged_paged_attention_reference on ragged batches whose caches hold NaN everywhere a row may
not read (the interpreter's outputs start as NaN, so an unwritten token shows too); the real lowering
for CUDA at Qwen3 step shapes; bad input refused; on a GPU (`-m gpu`) the real kernel against the
reference at Qwen3-0.6B's shapes."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention_mgpu import (
    META_FIELDS,
    RaggedConfig,
    num_tiles,
    ragged_paged_attention_mgpu,
    tile_schedule,
)
from tests.kernels.test_ragged_paged_attention import build_batch, device_args

on_gpu = jax.default_backend() == "gpu"


# ----------------------------------------------------------------------------------------
# The tile schedule against a plain loop
# ----------------------------------------------------------------------------------------


def schedule_by_loop(rows, num_seqs, *, T, TQ, max_context):
    """The tiles a row needs, by a plain loop: windows of TQ tokens from the row's first token rounded
    down to 8; each tile's tokens, and its key count (the last token's position + 1). Then the padding
    tokens as tiles without keys. Returns sorted (q0, qn, num_keys, row) tuples."""
    tiles, start = [], 0
    for i, (q_len, ctx) in enumerate(rows[:num_seqs]):
        end, window = start + q_len, start // 8 * 8
        while window < end:
            q0, q1 = max(start, window), min(end, window + TQ)
            if q1 > q0:
                tiles.append((q0, q1 - q0, min(ctx, max_context) - (end - q1), i))
            window += TQ
        start = end
    window = start // 8 * 8
    while window < T:  # the padding tokens
        q0, q1 = max(start, window), min(T, window + TQ)
        if q1 > q0:
            tiles.append((q0, q1 - q0, 0, None))
        window += TQ
    return sorted(tiles, key=lambda t: t[:3])


@functools.lru_cache(maxsize=None)
def schedule_fn(T, R, TQ, max_context):
    return jax.jit(functools.partial(tile_schedule, num_tokens=T, num_rows=R, tile_tokens=TQ,
                                     max_context=max_context))


# (rows as (q_len, context), R, T, TQ, max_context): a prefill starting off the 8-token grid, decode rows
# side by side, an empty row, a row whose chunk ends the step, padding rows and tokens; a batch that
# fills T; every row straddling two windows (the bound's worst case); random batches.
RANDOM_SCHEDULES = [
    ([(int(q), int(q) + int(c)) for q, c in zip(rng.integers(0, 9, n), rng.integers(0, 40, n))], 12, 64, 8, 64)
    for rng, n in ((np.random.default_rng(seed), 1 + seed % 12) for seed in range(8))
]
SCHEDULES = [
    ([(3, 70), (1, 37), (0, 10), (41, 120), (1, 1), (9, 9)], 8, 72, 32, 128),
    ([(20, 20), (1, 200), (17, 80)], 4, 40, 16, 256),
    ([(1, 5)] * 6 + [(10, 12)], 7, 16, 8, 64),
    ([(64, 64), (0, 3)], 3, 64, 64, 512),
    ([], 2, 16, 8, 64),
    ([(7, 7)] + [(8, 20)] * 5, 6, 48, 8, 64),
] + [case for case in RANDOM_SCHEDULES if sum(q for q, _ in case[0]) <= case[2]]


@pytest.mark.parametrize("case", range(len(SCHEDULES)))
def test_tile_schedule_matches_a_plain_loop(case):
    rows, R, T, TQ, max_context = SCHEDULES[case]
    qsl = np.zeros(R + 1, np.int32)
    qsl[1:len(rows) + 1] = np.cumsum([q for q, _ in rows], dtype=np.int32)
    qsl[len(rows) + 1:] = qsl[len(rows)]
    lens = np.zeros(R, np.int32)
    lens[:len(rows)] = [c for _, c in rows]
    meta = np.asarray(schedule_fn(T, R, TQ, max_context)(qsl, lens, np.int32(len(rows))))
    assert meta.shape == (num_tiles(T, R, TQ), len(META_FIELDS))
    field = {name: meta[:, i] for i, name in enumerate(META_FIELDS)}
    work = field["qn"] > 0
    got = sorted(((int(m[1]), int(m[2]), int(m[5]), int(m[0]) if m[5] else None) for m in meta[work]),
                 key=lambda t: t[:3])
    want = schedule_by_loop(rows, len(rows), T=T, TQ=TQ, max_context=max_context)
    # A zero tile's row is whatever it is; a tile with keys names its row.
    assert [(a, b, c) for a, b, c, _ in got] == [(a, b, c) for a, b, c, _ in want]
    assert [r for *_, r in got if r is not None] == [r for *_, r in want if r is not None]
    window = field["window_8"] * 8
    assert ((window >= 0) & (window <= T - TQ)).all()
    assert ((field["q0"] >= window) & (field["q0"] + field["qn"] <= window + TQ))[work].all()
    # The window's position: the row's last token sits at context - 1.
    for m in meta[work & (field["num_keys"] > 0)]:
        row = int(m[0])
        last_pos = m[4] + (m[1] + m[2] - 1 - m[3] * 8)
        assert last_pos == lens[row] - 1 - (qsl[row + 1] - (m[1] + m[2]))
    assert (np.diff(field["num_keys"]) <= 0).all()  # longest first


# ----------------------------------------------------------------------------------------
# The kernel in the interpreter against the reference
# ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def kernel_fn(config, sm_scale, params=None):
    return jax.jit(functools.partial(ragged_paged_attention_mgpu, sm_scale=sm_scale, config=config,
                                     interpret=params or not on_gpu))


@functools.lru_cache(maxsize=None)
def reference_fn(sm_scale):
    return jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=sm_scale))


def check(batch, config=None, *, params=None):
    """The kernel == the reference within bf16 rounding (P and the output are rounded to bf16); the
    padding tokens exactly 0; no NaN anywhere."""
    sm_scale = batch["q"].shape[-1] ** -0.5
    args = device_args(batch)
    out = np.asarray(kernel_fn(config, sm_scale, params)(*args), np.float32)
    ref = np.asarray(reference_fn(sm_scale)(*args), np.float32)
    assert out.shape == batch["q"].shape
    assert not np.isnan(out).any(), f"NaN at tokens {np.where(np.isnan(out).any((1, 2)))[0]}"
    np.testing.assert_array_equal(out[batch["qsl"][batch["num_seqs"]]:], 0.0)
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err <= 1e-2, f"max error {err:.2e} of the largest output"


# (rows as (q_len, context), R, T, Hq, Hkv, D, block_size, max_blocks, config): G = 4 with 32-token pages
# and a ring of 3 stages that a 200-token row reuses (run with the interpreter's race detector: stages
# refilled after their reads, P's tile rewritten every step, neighbouring tiles' stores into one 8-row
# window); G = 1 with 128-token pages, 128-key tiles and a ring of one stage; G = 8 at head_dim 128 and
# fewer tokens than one window (q padded).
CASES = {
    "g4_bs32_ring3_races": ([(20, 20), (1, 200), (17, 80)], 4, 40, 8, 2, 64, 32, 7, RaggedConfig(3)),
    "g1_bs128_kv128_one_stage": ([(70, 130), (1, 5)], 3, 72, 2, 2, 64, 128, 2, RaggedConfig(1, block_kv=128)),
    "g8_d128_t_below_window": ([(4, 12), (1, 50)], 2, 5, 16, 2, 128, 16, 4, RaggedConfig()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_kernel_matches_reference(case):
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # the race detector's state is private
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rows, R, T, hq, hkv, d, bs, max_blocks, config = CASES[case]
    batch = build_batch(rows, T=T, R=R, Hq=hq, Hkv=hkv, D=d, bs=bs, num_blocks=R * max_blocks + 3,
                        max_blocks=max_blocks, dtype=jnp.bfloat16, seed=len(rows))
    races = case.endswith("_races") and not on_gpu
    check(batch, config, params=plgpu.InterpretGPUParams(detect_races=True) if races else None)
    if races:
        assert not gpu_callbacks.get_races().races_found


@pytest.mark.parametrize("decode_kernel", ["pallas", "mgpu"])
def test_engine_attention_through_the_ragged_kernel_matches_the_reference_path(decode_kernel):
    """PagedAttention as the runners build it with `ragged_kernel="mgpu"` (G = 2): prefill chunks over
    earlier context (one off the 8-token grid), decode rows side by side (through `decode_kernel`'s
    kernel), an empty row, padding rows and tokens. This step's K/V are written first (the Triton KV
    write), then attended: the outputs equal the jnp reference path's, the padding tokens' are 0, the
    caches are the same."""
    from mrv2_jax.models.attention import PagedAttention

    rows = [(3, 70), (1, 37), (0, 10), (41, 120), (1, 1), (9, 9)]
    b = build_batch(rows, T=72, R=8, Hq=4, Hkv=2, D=64, bs=16, num_blocks=67, max_blocks=8, dtype=jnp.bfloat16)
    q, k_cache, v_cache, layer, block_tables, seq_lens, qsl, num_seqs = device_args(b)
    slots = np.full(72, -1, np.int32)  # each token's cache slot: its row's last q_len positions
    for i, (q_len, ctx) in enumerate(rows):
        pos = np.arange(ctx - q_len, ctx)
        slots[b["qsl"][i]:b["qsl"][i + 1]] = b["block_tables"][i, pos // 16] * 16 + pos % 16
    k_new, v_new = (jax.random.normal(jax.random.key(s), (72, 2, 64), jnp.bfloat16) for s in (7, 8))
    meta = dict(slot_mapping=jax.device_put(slots), block_tables=block_tables, seq_lens=seq_lens,
                query_start_loc=qsl, num_seqs=num_seqs)

    @functools.partial(jax.jit, static_argnames="options")
    def attend(meta, q, k_new, v_new, layer, cache, options):
        return PagedAttention(**meta, **dict(options))(q, k_new, v_new, layer, cache, 0.125)

    cache = (k_cache, v_cache)
    want, want_cache = attend(meta, q, k_new, v_new, layer, cache, options=(("use_kernels", False),))
    got, got_cache = attend(meta, q, k_new, v_new, layer, cache,
                            options=(("use_kernels", True), ("interpret", not on_gpu), ("ragged_kernel", "mgpu"),
                                     ("decode_kernel", decode_kernel)))
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[b["qsl"][len(rows)]:], 0.0)
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-2
    for g, w in zip(got_cache, want_cache):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize(("one_token_rows", "decode_kernel", "kernels"), [
    # A mixed step: the Mosaic GPU ragged kernel, and decode_kernel's for its one-token rows.
    (False, "pallas", {"ragged_paged_attention_mgpu", "ragged_paged_attention"}),
    (False, "mgpu", {"ragged_paged_attention_mgpu", "paged_decode_attention_mgpu"}),
    (True, "pallas", {"ragged_paged_attention"}),  # fused decode: one token per row, the Triton kernel
    (True, "mgpu", {"paged_decode_attention_mgpu"}),
])
def test_one_token_rows_never_take_the_mosaic_gpu_ragged_kernel(one_token_rows, decode_kernel, kernels):
    """With `ragged_kernel="mgpu"`, the kernels a step's program calls: the Mosaic GPU ragged kernel and
    `decode_kernel`'s for mixed steps, `decode_kernel`'s alone for fused decode's one-token rows."""
    from mrv2_jax.models.attention import PagedAttention

    s = jax.ShapeDtypeStruct
    i32 = functools.partial(s, dtype=jnp.int32)
    cache = s((2, 16, 2, 16, 64), jnp.bfloat16)
    q, kv = s((8, 4, 64), jnp.bfloat16), s((8, 2, 64), jnp.bfloat16)

    def step(slots, tables, lens, qsl, num_seqs, q, k, v, layer, cache):
        attention = PagedAttention(slots, tables, lens, qsl, num_seqs, interpret=True, ragged_kernel="mgpu",
                                   one_token_rows=one_token_rows, decode_kernel=decode_kernel)
        return attention(q, k, v, layer, cache, 0.125)

    jaxpr = str(jax.make_jaxpr(step)(i32((8,)), i32((8, 4)), i32((8,)), i32((9,)), i32(()), q, kv, kv, i32(()),
                                     (cache, cache)))
    names = set(re.findall(r"\b(?:ragged_paged_attention|paged_decode_attention)\w*", jaxpr))
    assert names == kernels, names


# ----------------------------------------------------------------------------------------
# The real lowering, and bad input
# ----------------------------------------------------------------------------------------


def step_shapes(T, R, hq, hkv, d=128, bs=16, ctx=2048, layers=28):
    s = jax.ShapeDtypeStruct
    cache = s((layers, R * ctx // bs + 1, hkv, bs, d), jnp.bfloat16)
    return (s((T, hq, d), jnp.bfloat16), cache, cache, s((), jnp.int32), s((R, ctx // bs), jnp.int32),
            s((R,), jnp.int32), s((R + 1,), jnp.int32), s((), jnp.int32))


@pytest.mark.parametrize(("T", "R", "hq", "config"), [
    (8192, 1024, 16, RaggedConfig()),  # Qwen3-0.6B, S2's step (G = 2)
    (2048, 64, 32, RaggedConfig(4)),  # Qwen3-8B (G = 4), a deeper ring
    (8192, 1024, 16, RaggedConfig(2, block_kv=128)),  # 128-key tiles, ~176 KB of shared memory
])
def test_cuda_lowering_accepts_qwen3_step_shapes(T, R, hq, config):
    """The real Mosaic GPU lowering (layouts, swizzles, wgmma shapes, TMA with the windows' proven
    8-row alignment, shared memory) takes the kernel at these shapes."""
    f = jax.jit(functools.partial(ragged_paged_attention_mgpu, sm_scale=128**-0.5, config=config))
    f.trace(*step_shapes(T, R, hq, 8)).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("decode_kernel", ["pallas", "mgpu"])
def test_cuda_lowering_accepts_a_mixed_step_with_its_decode_rows_split_off(decode_kernel, monkeypatch):
    """PagedAttention's mixed step with `ragged_kernel="mgpu"` at S2's step shapes (Qwen3-0.6B): the
    Mosaic GPU ragged kernel and `decode_kernel`'s over the rows (the Triton one's modules verified)
    lower for CUDA together."""
    from mrv2_jax.models.attention import _mixed_rows_mgpu
    from tests.triton_lowering import verify_triton_lowering

    verified = verify_triton_lowering(monkeypatch)
    f = jax.jit(functools.partial(_mixed_rows_mgpu, sm_scale=128**-0.5, decode_kernel=decode_kernel))
    text = f.trace(*step_shapes(8192, 1024, 16, 8)).lower(lowering_platforms=("cuda",)).as_text()
    assert "ragged_paged_attention_mgpu" in text
    assert verified == ([True] if decode_kernel == "pallas" else [])
    assert ("paged_decode_attention_mgpu" in text) == (decode_kernel == "mgpu")


def test_cuda_lowering_refuses_too_much_shared_memory():
    f = jax.jit(functools.partial(ragged_paged_attention_mgpu, sm_scale=128**-0.5, config=RaggedConfig(8)))
    with pytest.raises(ValueError, match="shared memory"):
        f.trace(*step_shapes(512, 8, 16, 8)).lower(lowering_platforms=("cuda",))


def _bad(q=(8, 4, 64), cache=(2, 8, 2, 16, 64), bt=(4, 3), lens=(4,), qsl=(5,), dtypes=None, v_cache=None):
    qd, kd = dtypes or (jnp.bfloat16, jnp.bfloat16)
    return (np.zeros(q, qd), np.zeros(cache, kd), np.zeros(v_cache or cache, kd), np.int32(0), np.zeros(bt, np.int32),
            np.zeros(lens, np.int32), np.zeros(qsl, np.int32), np.int32(1))


@pytest.mark.parametrize(("args", "kwargs", "match"), [
    (_bad(q=(8, 1, 4, 64)), {}, "q must be \\[T, Hq, D\\]"),
    (_bad(v_cache=(2, 8, 2, 32, 64)), {}, "k_cache and v_cache must both be"),
    (_bad(q=(8, 4, 128)), {}, "q's head_dim = 128 differs from the cache's 64"),
    (_bad(q=(8, 6, 64)), {}, "G = Hq / Hkv must be 1, 2, 4 or 8"),
    (_bad(q=(8, 32, 64)), {}, "got Hq = 32, Hkv = 2"),
    (_bad(dtypes=(jnp.float32, jnp.bfloat16)), {}, "must be bfloat16, got q float32"),
    (_bad(q=(8, 4, 32), cache=(2, 8, 2, 16, 32)), {}, "head_dim = 32 must be a multiple of 64"),
    (_bad(cache=(2, 8, 2, 12, 64)), {}, "block_size = 12 must be a multiple of 8"),
    (_bad(qsl=(4,)), {}, "query_start_loc \\[R \\+ 1\\] disagree"),
    (_bad(), {"config": RaggedConfig(0)}, "max_concurrent_steps = 0 must be positive"),
    (_bad(), {"config": RaggedConfig(block_kv=96)}, "block_kv = 96 must be 64 or 128"),
    (_bad(cache=(2, 8, 2, 48, 64)), {"config": RaggedConfig(block_kv=128)}, "block_size = 48 .* that it divides"),
    (_bad(), {"sliding_window": 128}, "no sliding window"),
])
def test_bad_input_raises(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention_mgpu(*args, sm_scale=0.125, interpret=True, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, RaggedConfig(3), RaggedConfig(2, block_kv=128)])
def test_gpu_qwen3_step_matches_reference(config):
    """The real kernel at Qwen3-0.6B's heads: three prefill chunks over earlier context (one of them
    off the 8-token grid), 40 decode rows of up to 2K tokens, padding rows and tokens."""
    rng = np.random.default_rng(0)
    rows = [(500, 1500), (1000, 1000), (333, 2000)] + [(1, int(c)) for c in rng.integers(1, 2048, 40)]
    batch = build_batch(rows, T=2048, R=48, Hq=16, Hkv=8, D=128, bs=16, num_blocks=48 * 128 + 3, max_blocks=128,
                        dtype=jnp.bfloat16, seed=1)
    check(batch, config)
