"""The sampler's one pass over the logits (mrv2_jax/sample/logit_stats.py) and its Pallas
kernels (pallas_kernels/logit_stats.py) against numpy, and the sampler with the kernels
against the sampler without them.

On the CPU the kernels run in the Pallas interpreter at small shapes (a vocabulary that is
not a multiple of the block or of the tile, so the masked tails run); `-m gpu` runs them
compiled at 256 x 151,936. `test_kernels_lower_to_triton` lowers them for CUDA on the CPU."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrv2_jax.sample import SamplerFeatures, SamplingTensors, sample
from mrv2_jax.sample import logit_stats as ls
from mrv2_jax.sample.block_top import top_n_by_blocks
from mrv2_jax.sample.features import SamplerKernels
from mrv2_jax.sample.penalties import PenaltyData, pack_token_mask, penalty_arrays
from pallas_kernels import logit_stats as pk
from tests.triton_lowering import verify_triton_lowering

ON_GPU = jax.default_backend() == "gpu"
# The jnp code under test, each run as one program (op by op, every op would compile its own).
# Host arrays reach the device by device_put or as jit arguments: jnp.asarray(numpy) compiles a
# program per shape.
logit_stats_reference = jax.jit(ls.logit_stats_reference)
block_max_and_sumexp = jax.jit(ls.block_max_and_sumexp)
mass_from_blocks = jax.jit(ls.mass_from_blocks)
logsumexp_from_blocks = jax.jit(ls.logsumexp_from_blocks)
count_above_reference = jax.jit(functools.partial(ls.count_above, mode="reference"))
refresh_blocks = jax.jit(ls.refresh_blocks)
top_n = jax.jit(top_n_by_blocks, static_argnums=1)
top_k = jax.jit(jax.lax.top_k, static_argnums=1)


def random_case(rng, r, v, num_slots, logits_dtype=jnp.bfloat16, counts_dtype=np.uint16):
    logits = rng.normal(0, 3, (r, v)).astype(np.float32)
    logits[0, : v // 2] = -np.inf  # a row whose first blocks are all -inf
    logits[1] = -np.inf  # a row of -inf (a fully masked row)
    logits[2, 5:9] = logits[2].max() + 1  # ties at the top
    counts = rng.integers(0, 4, (num_slots, v)) * (rng.random((num_slots, v)) < 0.2)
    prompt = rng.random((num_slots, v)) < 0.1
    rows = rng.permutation(num_slots)[:r]
    t = SamplingTensors.neutral(r, max_bias=0, max_stop=0, xp=jnp)
    t = dataclasses.replace(
        t, repetition_penalty=jax.device_put(rng.uniform(0.5, 2, r).astype(np.float32)),
        frequency_penalty=jax.device_put(rng.uniform(-1, 1, r).astype(np.float32)),
        presence_penalty=jax.device_put(rng.uniform(-1, 1, r).astype(np.float32)))
    data = PenaltyData(jax.device_put(counts.astype(counts_dtype)), jax.device_put(pack_token_mask(prompt, np)),
                       jax.device_put(rows.astype(np.int32)))
    return jax.device_put(logits.astype(logits_dtype)), t, data, dict(counts=counts, prompt=prompt, rows=rows)


def numpy_stats(logits, t, raw_np, divisor):
    """Independent: the penalty formula per element in numpy, blocks by explicit slicing."""
    x = np.asarray(logits).astype(np.float64)
    counts = raw_np["counts"][raw_np["rows"]]
    seen = raw_np["prompt"][raw_np["rows"]] | (counts > 0)
    rep = np.asarray(t.repetition_penalty, np.float64)[:, None]
    pen = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    pen = pen - np.asarray(t.frequency_penalty, np.float64)[:, None] * counts
    pen = pen - np.asarray(t.presence_penalty, np.float64)[:, None] * (counts > 0)
    edges = list(range(0, x.shape[1], ls.BLOCK))

    def blocks(a, d):
        m = np.stack([a[:, s : s + ls.BLOCK].max(axis=1) for s in edges], axis=1)
        shift = np.where(np.isneginf(m), 0.0, m)
        with np.errstate(invalid="ignore"):
            sums = [np.exp((a[:, s : s + ls.BLOCK] - shift[:, [i]]) / d[:, None]).sum(axis=1)
                    for i, s in enumerate(edges)]
        return m, np.stack(sums, axis=1)

    return pen, blocks(pen, np.asarray(divisor, np.float64)), blocks(x, np.ones(len(x)))


def assert_stats(got, pen, pen_blocks, raw_blocks):
    close = dict(rtol=2e-6, atol=0)
    np.testing.assert_allclose(got.processed, pen, **close)
    np.testing.assert_allclose(got.block_max, pen_blocks[0], **close)
    np.testing.assert_allclose(got.block_sumexp, pen_blocks[1], rtol=1e-5)
    np.testing.assert_array_equal(got.raw_block_max, raw_blocks[0])
    np.testing.assert_allclose(got.raw_block_sumexp, raw_blocks[1], rtol=1e-5)


@pytest.mark.parametrize("logits_dtype,counts_dtype", [(jnp.bfloat16, np.uint16), (jnp.float32, np.int32)])
@pytest.mark.parametrize("impl", ["reference", "kernel", "kernel_loop"])
def test_stats_match_numpy(impl, logits_dtype, counts_dtype):
    rng = np.random.default_rng(0)
    r, v = 5, 3 * 128 * 2 + 77  # tails in the last block and in the last tile (tile_blocks=2)
    logits, t, data, raw_np = random_case(rng, r, v, 7, logits_dtype, counts_dtype)
    divisor = jax.device_put(np.array([1.0, 0.7, 2.0, 1.0, 0.3], np.float32))
    if impl.startswith("kernel"):
        launch = dict(interpret=True, tile_blocks=2, tiles_per_program=2 if impl == "kernel_loop" else 1)
        got = pk.logit_stats(logits, divisor, penalty_arrays(t, data), **launch)
        plain = pk.logit_stats(logits, divisor, **launch)
    else:
        got = logit_stats_reference(logits, t, data, divisor)
        plain = logit_stats_reference(logits, None, None, divisor)
    pen, pen_blocks, raw_blocks = numpy_stats(logits, t, raw_np, divisor)
    assert_stats(got, pen, pen_blocks, raw_blocks)
    # Without penalties the "penalised" logits are the raw ones in f32.
    raw = np.asarray(logits).astype(np.float64)
    _, raw_scaled_blocks, _ = numpy_stats(logits, dataclasses.replace(
        t, repetition_penalty=np.ones(r), frequency_penalty=np.zeros(r), presence_penalty=np.zeros(r)),
        raw_np, divisor)
    assert_stats(plain, raw, raw_scaled_blocks, raw_blocks)


def test_mass_from_blocks_matches_numpy():
    rng = np.random.default_rng(5)
    x = rng.normal(0, 4, (3, 900)).astype(np.float32)
    x[2, 100:] = -np.inf
    divisor = np.array([1.0, 0.5, 1.7], np.float32)
    got = mass_from_blocks(*block_max_and_sumexp(x, divisor), divisor)
    xd = x.astype(np.float64)
    want = np.exp((xd - xd.max(axis=1, keepdims=True)) / divisor[:, None]).sum(axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_logsumexp_from_blocks_matches_numpy():
    rng = np.random.default_rng(1)
    x = rng.normal(0, 5, (4, 1000)).astype(np.float32)
    x[1, :900] = -np.inf
    x[2] = -np.inf
    got = logsumexp_from_blocks(*block_max_and_sumexp(x))
    with np.errstate(divide="ignore"):
        want = np.log(np.exp(x.astype(np.float64)).sum(axis=1))
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_count_above_matches_numpy(impl):
    rng = np.random.default_rng(2)
    r, v = 6, 128 * 5 + 3
    x = rng.normal(0, 2, (r, v)).astype(np.float32)
    x[3] = -np.inf
    if impl == "kernel":  # the kernel reads the logits in their own dtype
        x = x.astype(jnp.bfloat16).astype(np.float32)
    threshold = np.array([x[0].max(), np.inf, -np.inf, 0.0, x[4, 17], np.sort(x[5])[-40]], np.float32)
    block_max, _ = block_max_and_sumexp(x)
    if impl == "kernel":
        got = pk.count_above(x.astype(jnp.bfloat16), block_max, threshold, interpret=True, tile_blocks=2)
    else:
        got = count_above_reference(x, block_max, threshold)
    np.testing.assert_array_equal(got, (x > threshold[:, None]).sum(axis=1))


def test_refresh_blocks_recomputes_edited_blocks():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 700)).astype(np.float32)
    divisor = np.array([1.0, 0.5, 2.0], np.float32)
    blocks = block_max_and_sumexp(x, divisor)
    ids = np.array([[0, 129, 699], [5, 6, 700], [700, 700, 300]])  # 700 = no id
    edited = x.copy()
    for i, row in enumerate(ids):
        for j in row[row < 700]:
            edited[i, j] = -np.inf if j % 2 else 50.0
    got = refresh_blocks(*blocks, edited, ids.astype(np.int32), divisor)
    want = block_max_and_sumexp(edited, divisor)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    assert not np.array_equal(want[0], blocks[0])  # the edits moved some maxima


def test_top_n_from_given_block_maxima():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(4, 64 * 128 + 900)).astype(np.float32)
    x[1, ::300] = 9.0  # ties spread over blocks
    block_max, _ = block_max_and_sumexp(x)
    for n in (20, 64):
        got = top_n(x, n, block_max=block_max)
        want = top_k(x, n)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def every_feature_case(logits_dtype=jnp.float32, v=64 * 128 + 300):
    """Every feature on, rows wide enough for both block levels. -> (logits, t, data, step):
    step(logits, t, data, kernels=SamplerKernels()) runs the sampler with those kernel choices."""
    rng = np.random.default_rng(6)
    r = 6
    logits, t, data, _ = random_case(rng, r, v, 8, jnp.float32, np.int32)
    logits = np.array(logits)
    logits[1] = rng.normal(0, 3, v)  # no row of -inf here
    columns = dict(
        temperature=np.array([0, 0.8, 1, 1, 0.5, 1.2], np.float32), top_k=np.array([0, 50, 0, 200, 20, 0], np.int32),
        top_p=np.array([1, 0.9, 0.7, 1, 1, 0.95], np.float32), min_p=np.array([0, 0.05, 0, 0, 0.1, 0], np.float32),
        seeds=np.arange(r, dtype=np.int32) * 7919, bias_ids=rng.integers(0, v, (r, 4)).astype(np.int32),
        bias_values=rng.normal(0, 20, (r, 4)).astype(np.float32))
    t = dataclasses.replace(t, **{name: jax.device_put(value) for name, value in columns.items()})
    f = SamplerFeatures.all(prompt_logprobs=False, min_tokens=False)

    @functools.partial(jax.jit, static_argnames="kernels")
    def step(x, t, pen, kernels=SamplerKernels()):
        return sample(x, t, jnp.arange(r, dtype=jnp.int32), f.replace(kernels=kernels), pen)

    return jax.device_put(logits.astype(logits_dtype)), t, data, step


def test_sampler_with_kernels_matches_without():
    """The same tokens and logprobs with the kernels (interpreted) as with the jnp pass, and
    logprobs as numpy's log_softmax."""
    logits, t, data, step = every_feature_case()
    r = logits.shape[0]
    off, kern = (step(logits, t, data, kernels=SamplerKernels(logit_stats=mode)) for mode in ("reference", "interpret"))
    np.testing.assert_array_equal(kern.tokens, off.tokens)
    np.testing.assert_array_equal(kern.logprob_token_ids, off.logprob_token_ids)
    np.testing.assert_array_equal(kern.sampled_rank, off.sampled_rank)
    np.testing.assert_allclose(kern.logprobs, off.logprobs, rtol=1e-6, atol=1e-5)
    x = np.asarray(logits, np.float64)
    log_softmax = x - np.log(np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True)) - x.max(
        axis=1, keepdims=True)
    np.testing.assert_allclose(kern.logprobs, np.take_along_axis(log_softmax, np.asarray(kern.logprob_token_ids), 1),
                               atol=1e-5)
    sampled = x[np.arange(r), np.asarray(kern.tokens)]
    np.testing.assert_array_equal(kern.sampled_rank, 1 + (x > sampled[:, None]).sum(axis=1))


@pytest.mark.parametrize("mode", ["reference", "interpret"])
def test_sampler_reads_bf16_logits_as_their_f32_values(mode):
    """The step hands the sampler bf16 logits (runner/model_step.py): every output equals the
    one from the same logits converted to f32 first."""
    kernels = SamplerKernels(logit_stats=mode)
    logits, t, data, step = every_feature_case(jnp.bfloat16)
    got = step(logits, t, data, kernels=kernels)
    want = step(np.asarray(logits).astype(np.float32), t, data, kernels=kernels)
    for name in ("tokens", "logprob_token_ids", "sampled_rank"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-6, atol=1e-6)


def test_kernels_lower_to_triton(monkeypatch):
    """Lower both kernels for CUDA at serving shapes and verify the Triton IR, without a GPU
    (tests/triton_lowering.py)."""
    verified = verify_triton_lowering(monkeypatch)
    S = jax.ShapeDtypeStruct
    r, v, n = 256, 151936, 512
    t = jax.eval_shape(lambda: SamplingTensors.neutral(r, max_bias=16, max_stop=4, xp=jnp))
    data = PenaltyData(S((n, v), jnp.uint16), S((n, (v + 31) // 32), jnp.uint32), S((r,), jnp.int32))
    cuda = dict(lowering_platforms=("cuda",))
    divisor = S((r,), jnp.float32)
    penalties = penalty_arrays(t, data)
    text = jax.jit(pk.logit_stats).trace(S((r, v), jnp.bfloat16), divisor, penalties).lower(**cuda).as_text()
    text += jax.jit(pk.logit_stats).trace(S((r, v), jnp.bfloat16), divisor).lower(**cuda).as_text()
    looped = functools.partial(pk.logit_stats, tiles_per_program=4, num_stages=2)
    text += jax.jit(looped).trace(S((r, v), jnp.bfloat16), divisor, penalties).lower(**cuda).as_text()
    text += jax.jit(pk.count_above).trace(S((r, v), jnp.bfloat16), S((r, ls.num_blocks(v)), jnp.float32),
                                          S((r,), jnp.float32)).lower(**cuda).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 4
    assert verified == [True] * 4


@pytest.mark.gpu
def test_gpu_kernels_match_reference_at_serving_shape():
    rng = np.random.default_rng(7)
    r, v = 256, 151936
    logits, t, data, _ = random_case(rng, r, v, 300)
    divisor = jnp.asarray(rng.uniform(0.2, 2, r), jnp.float32)
    got = pk.logit_stats(logits, divisor, penalty_arrays(t, data))
    want = jax.jit(ls.logit_stats_reference)(logits, t, data, divisor)
    for name in ("processed", "block_max", "block_sumexp", "raw_block_sumexp"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-5, err_msg=name)
    np.testing.assert_array_equal(got.raw_block_max, want.raw_block_max)
    threshold = jnp.asarray(np.sort(np.asarray(logits, np.float32), axis=1)[:, -int(rng.integers(1, 100))])
    np.testing.assert_array_equal(pk.count_above(logits, got.raw_block_max, threshold),
                                  jnp.sum(logits.astype(jnp.float32) > threshold[:, None], axis=1))


def test_tables_past_int32_offsets_take_the_jnp_path():
    """A counts table of >= 2**31 entries (say 16K slots x 152K ids) cannot be addressed by the
    kernels' int32 offsets: the sampler uses the jnp pass instead of failing to compile."""
    S = jax.ShapeDtypeStruct
    r, v = 4, 151936
    t = jax.eval_shape(lambda: SamplingTensors.neutral(r, max_bias=0, max_stop=0, xp=jnp))
    huge = PenaltyData(S((2**31 // v + 1, v), jnp.uint16), S((2**31 // v + 1, (v + 31) // 32), jnp.uint32),
                       S((r,), jnp.int32))
    text = jax.jit(lambda x, t, p: ls.logit_stats(x, t, p, mode="interpret").block_max).trace(
        S((r, v), jnp.bfloat16), t, huge).lower().as_text()
    assert "logit_stats" not in text  # no Pallas call (interpreted kernels would show their name)
    small = PenaltyData(S((8, v), jnp.uint16), S((8, (v + 31) // 32), jnp.uint32), S((r,), jnp.int32))
    text = jax.jit(lambda x, t, p: ls.logit_stats(x, t, p, mode="interpret").block_max).trace(
        S((r, v), jnp.bfloat16), t, small).lower().as_text()
    assert "logit_stats" in text
