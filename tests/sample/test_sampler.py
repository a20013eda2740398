"""The device sampler against an independent numpy reference (tests/sampler_reference.py):
each transform, their combinations, sampled distributions, batch invariance and logprobs."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from mrv2_jax.sample import SamplerFeatures, SamplingTensors, sample
from mrv2_jax.sample.block_top import top_n_by_blocks
from mrv2_jax.sample.gumbel import gumbel_noise
from mrv2_jax.sample.penalties import PenaltyData, penalty_data_from_tokens
from mrv2_jax.sample.sampler import adjust_logits, sample_tokens, truncation_threshold
from mrv2_jax.sample.tensors import needed_features
from mrv2_jax.sample.topk_topp import _key_to_float, _ordered_key, top_k_threshold_search
from tests import sampler_reference as ref

ALL = SamplerFeatures.all()
MB, MS = 8, 4  # small sparse widths keep the tests quick
# The jnp functions under test as one program each (op by op, every op compiles its own).
# Host arrays go to them as numpy: jnp.asarray(numpy) compiles a program per shape.
noise = jax.jit(gumbel_noise, static_argnums=2)
top_n = jax.jit(top_n_by_blocks, static_argnums=1, static_argnames="blocks")
lax_top_k = jax.jit(jax.lax.top_k, static_argnums=1)


def make_tensors(num_rows, **columns) -> SamplingTensors:
    """Neutral rows with some columns replaced (numpy values, any shape that broadcasts)."""
    t = SamplingTensors.neutral(num_rows, MB, MS)
    fields = {}
    for f in dataclasses.fields(t):
        value = np.array(getattr(t, f.name))
        if f.name in columns:
            value[...] = columns[f.name]
        fields[f.name] = jax.device_put(value)
    return SamplingTensors(**fields)


def random_requests(rng, num_rows, vocab):
    """Random per-row parameters touching every feature, and the reference's view of them."""
    rows = []
    for _ in range(num_rows):
        bias = {int(i): float(rng.uniform(-5, 5)) for i in rng.choice(vocab, rng.integers(0, MB + 1), replace=False)}
        rows.append(dict(
            bias=bias, stop_ids=[int(i) for i in rng.choice(vocab, rng.integers(0, MS + 1), replace=False)],
            min_tokens=int(rng.integers(0, 4)), num_output=int(rng.integers(0, 4)),
            prompt=rng.integers(0, vocab, rng.integers(1, 30)).tolist(),
            output=rng.integers(0, vocab, rng.integers(0, 30)).tolist(),
            rep=float(rng.choice([1.0, rng.uniform(0.5, 2.0)])), pres=float(rng.choice([0.0, rng.uniform(-2, 2)])),
            freq=float(rng.choice([0.0, rng.uniform(-2, 2)]))))
    return rows


def tensors_for(rows, **extra) -> SamplingTensors:
    r = len(rows)
    bias_ids, bias_values = np.full((r, MB), -1), np.zeros((r, MB))
    stop_ids = np.full((r, MS), -1)
    for i, row in enumerate(rows):
        bias_ids[i, : len(row["bias"])] = list(row["bias"])
        bias_values[i, : len(row["bias"])] = list(row["bias"].values())
        stop_ids[i, : len(row["stop_ids"])] = row["stop_ids"]
    col = lambda key: np.array([row[key] for row in rows])  # noqa: E731
    return make_tensors(r, bias_ids=bias_ids, bias_values=bias_values, stop_ids=stop_ids,
                        min_tokens=col("min_tokens"), num_output_tokens=col("num_output"),
                        repetition_penalty=col("rep"), presence_penalty=col("pres"),
                        frequency_penalty=col("freq"), **extra)


def penalties_for(rows, vocab):
    return penalty_data_from_tokens([r["prompt"] for r in rows], [r["output"] for r in rows], vocab)


# --- logit_bias, min_tokens, penalties --------------------------------------------------------

@pytest.mark.parametrize("penalties_on", [True, False])
def test_bias_min_tokens_penalties_match_reference(penalties_on):
    rng = np.random.default_rng(0)
    r, v = 24, 300
    rows = random_requests(rng, r, v)
    if not penalties_on:
        for row in rows:
            row.update(rep=1.0, pres=0.0, freq=0.0)
    logits = rng.normal(0, 3, (r, v)).astype(np.float32)
    f = ALL.replace(penalties=penalties_on)
    got = jax.jit(lambda x, t, p: adjust_logits(x, t, f, p))(
        logits, tensors_for(rows), penalties_for(rows, v) if penalties_on else None)
    for i, row in enumerate(rows):
        want = ref.process_row(logits[i], **row)
        np.testing.assert_allclose(np.asarray(got[i]), want, rtol=1e-6, atol=1e-5)


# --- min_p / top_k / top_p --------------------------------------------------------------------

TRUNCATION_CASES = [  # (min_p, top_k, top_p), top_p None = "pick a safe random value"
    (0.0, 0, 1.0), (0.1, 0, 1.0), (0.0, 1, 1.0), (0.0, 7, 1.0), (0.0, 300, 1.0), (0.0, 5000, 1.0),
    (0.0, 0, None), (0.05, 40, None), (0.0, 20, None), (0.3, 3, 1.0), (1.0, 0, 1.0), (0.01, 0, None),
]


@pytest.mark.parametrize("features", [ALL, ALL.replace(top_k_top_p="sort"), ALL.replace(search_arity=4),
                                      ALL.replace(search_arity=256, runtime_skip=False)],
                         ids=["threshold16", "sort", "threshold4", "threshold256-static"])
def test_truncation_matches_reference(features):
    rng = np.random.default_rng(1)
    v = 300
    cases = TRUNCATION_CASES * 2
    scaled = rng.normal(0, 2.5, (len(cases), v)).astype(np.float32)
    scaled[len(TRUNCATION_CASES):] = np.round(scaled[len(TRUNCATION_CASES):])  # many ties
    min_p, top_k, top_p = (np.array(c, np.float64) for c in zip(*cases))
    for i, (mp, k, p) in enumerate(cases):
        if p is None:
            before = ref.kept_tokens(scaled[i], min_p=mp, top_k=k)
            top_p[i] = ref.safe_top_p(scaled[i], before, rng)
    t = make_tensors(len(cases), temperature=1.0, min_p=min_p, top_k=top_k.astype(int), top_p=top_p)
    thresh = np.asarray(jax.jit(lambda s, t: truncation_threshold(s, t, features))(scaled, t))
    for i in range(len(cases)):
        want = ref.kept_tokens(scaled[i], min_p=min_p[i], top_k=int(top_k[i]), top_p=top_p[i])
        got = scaled[i] >= thresh[i]
        assert (got == want).all(), f"case {cases[i]} (p={top_p[i]:.4f}), row {i}"


@pytest.mark.parametrize("runtime_skip", [True, False])
def test_truncation_fast_path_on_wide_rows(runtime_skip):
    """Rows wide enough for the block-maxima candidates (V > 64 blocks of 128): top_k below,
    at and above the candidate width, ties at the k-th value running past the candidates,
    top_p alone on flat and on peaked rows, and rows mixing the fast path with the search."""
    rng = np.random.default_rng(11)
    v = 64 * 128 + 300
    cases = [(0.0, 1, 1.0), (0.0, 20, None), (0.05, 50, None), (0.0, 63, 1.0), (0.0, 64, None),
             (0.0, 200, None), (0.0, 0, None), (0.0, 30, None), (0.0, 30, 1.0), (0.0, 0, 1.0),
             (0.0, 0, None), (0.02, 0, None)]
    scaled = rng.normal(0, 2.0, (len(cases), v)).astype(np.float32)
    scaled[7, rng.choice(v, 100, replace=False)] = scaled[7].max() + 1  # 100 tied at the top, k=30
    scaled[8] = np.round(scaled[8] * 2)  # ties everywhere
    scaled[10:, rng.choice(v, 40, replace=False)] += 14  # peaked: top_p alone cut among the top 64
    min_p, top_k, top_p = (np.array(c, np.float64) for c in zip(*cases))
    for i, (mp, k, p) in enumerate(cases):
        if p is None:
            top_p[i] = ref.safe_top_p(scaled[i], ref.kept_tokens(scaled[i], min_p=mp, top_k=k), rng)
    t = make_tensors(len(cases), temperature=1.0, min_p=min_p, top_k=top_k.astype(int), top_p=top_p)
    f = ALL.replace(runtime_skip=runtime_skip)
    thresh = np.asarray(jax.jit(lambda s, t: truncation_threshold(s, t, f))(scaled, t))
    # The sampled token: rows whose kept tokens are all among the top candidates sample from
    # those alone; it must be the whole-row argmax of (kept logit + the row's noise).
    positions = np.arange(len(cases), dtype=np.int32) * 7
    t = dataclasses.replace(t, seeds=np.arange(len(cases), dtype=np.int32) + 99)
    trunc_only = f.replace(logit_bias=False, min_tokens=False, penalties=False, num_logprobs=None,
                           prompt_logprobs=False)
    sample_fn = jax.jit(lambda s, t, p: sample(s, t, p, trunc_only).tokens)
    tokens = np.asarray(sample_fn(scaled, t, positions))
    row_noise = np.asarray(noise(t.seeds, positions, v))
    for i in range(len(cases)):
        want = ref.kept_tokens(scaled[i], min_p=min_p[i], top_k=int(top_k[i]), top_p=top_p[i])
        assert ((scaled[i] >= thresh[i]) == want).all(), f"case {cases[i]} (p={top_p[i]:.4f}), row {i}"
        assert tokens[i] == np.argmax(np.where(want, scaled[i] + row_noise[i], -np.inf)), f"case {cases[i]}, row {i}"


def test_kth_largest_search_is_exact_on_awkward_values():
    # (No subnormals: XLA flushes them to zero on CPU and GPU; logits never are.)
    rng = np.random.default_rng(2)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 1e-30, -1e-30, 3.4e38, -3.4e38, 1.0, 1.0, 1.0], np.float32)
    x = np.concatenate([rng.choice(special, (6, 40)), rng.normal(size=(6, 60)).astype(np.float32)], axis=1)
    k = rng.integers(1, 100, 6)
    got = np.asarray(jax.jit(top_k_threshold_search)(x, k.astype(np.int32)))
    want = [np.sort(row)[::-1][kk - 1] for row, kk in zip(x, k)]
    np.testing.assert_array_equal(got, np.float32(want) + np.float32(0))  # -0.0 == 0.0
    keys = np.asarray(jax.jit(_ordered_key)(x)).astype(np.int64)
    assert (np.diff(np.take_along_axis(keys, np.argsort(x, axis=1), 1), axis=1) >= 0).all()
    np.testing.assert_array_equal(np.asarray(jax.jit(_key_to_float)(keys.astype(np.uint32))), x)


# --- sampled distributions --------------------------------------------------------------------

DISTRIBUTION_CASES = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.6),
    "min_p": dict(temperature=1.3, min_p=0.15),
    "all": dict(temperature=0.9, top_k=6, top_p=0.8, min_p=0.05),
}


@pytest.mark.parametrize("case", list(DISTRIBUTION_CASES))
def test_sampled_frequencies_match_distribution(case):
    v, n = 12, 20_000
    logits = np.linspace(2.0, -1.5, v).astype(np.float32)[np.random.default_rng(3).permutation(v)]
    params = DISTRIBUTION_CASES[case]
    t = make_tensors(n, seeds=77, **params)
    # One request sampled at 20K positions = 20K independent draws (counter-based keys).
    f = ALL.replace(penalties=False, logit_bias=False, min_tokens=False, num_logprobs=None)
    tokens = run(f, np.broadcast_to(logits, (n, v)), t, np.arange(n, dtype=np.int32), None).tokens
    counts = np.bincount(np.asarray(tokens), minlength=v)
    scaled = logits / params["temperature"]
    keep = ref.kept_tokens(scaled, min_p=params.get("min_p", 0.0), top_k=params.get("top_k", 0),
                           top_p=params.get("top_p", 1.0))
    expected = ref.distribution(scaled, keep) * n
    assert counts[~keep].sum() == 0
    chi2 = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    assert chi2 < stats.chi2.ppf(1 - 1e-4, keep.sum() - 1), (case, counts, expected.round())


# --- whole sampler: variants, greedy rows, batch invariance -----------------------------------

def random_batch(rng, r, v):
    rows = random_requests(rng, r, v)
    extra = dict(temperature=rng.choice([0.0, 0.5, 1.0, 1.5], r), top_k=rng.choice([0, 1, 5, 50, v + 3], r),
                 top_p=rng.choice([1.0, 0.9, 0.5], r), min_p=rng.choice([0.0, 0.05], r),
                 seeds=rng.integers(0, 2**31, r), num_logprobs=rng.choice([-1, 0, 3], r))
    return rows, tensors_for(rows, **extra)


@functools.cache
def _jitted(features):
    return jax.jit(lambda x, t, p, pen: sample(x, t, p, features, pen))


def run(features, logits, t, positions, penalties):
    """One jitted function per feature set, so tests sharing shapes share compiles."""
    return _jitted(features)(logits, t, positions, penalties)


def test_runtime_skips_static_variants_and_sort_agree():
    rng = np.random.default_rng(4)
    r, v = 16, 200
    for uses_features in (True, False):
        rows, t = random_batch(rng, r, v)
        if not uses_features:  # a batch that uses nothing: the skipping branches run
            t = make_tensors(r, temperature=np.asarray(t.temperature), seeds=np.asarray(t.seeds))
        logits = rng.normal(0, 2, (r, v)).astype(np.float32)
        pos, pen = rng.integers(0, 1000, r).astype(np.int32), penalties_for(rows, v)
        needed = needed_features(jax.tree.map(np.asarray, t), v)
        outs = [run(f, logits, t, pos, pen).tokens for f in
                (ALL, ALL.replace(runtime_skip=False), ALL.replace(top_k_top_p="sort"),
                 needed.replace(num_logprobs=None, penalties=True))]
        for other in outs[1:]:
            np.testing.assert_array_equal(outs[0], other)


def test_mixed_batch_on_wide_rows_matches_the_sort_reference():
    """Rows wide enough for both levels of block maxima (V > 64 x 128): greedy rows (their
    token from the top candidates), top_k <= 64 rows (drawn among them), and rows that take the
    whole-row pass or the search, in one batch; every feature on. Same tokens as the sort
    method, which takes neither shortcut."""
    rng = np.random.default_rng(12)
    r, v = 12, 64 * 128 + 300
    rows = random_requests(rng, r, v)
    extra = dict(temperature=np.array([0, 0, 0.7, 1, 1, 1, 0.5, 1, 0, 1.2, 1, 1.0]),
                 top_k=np.array([0, 50, 20, 64, 0, 200, 1, 0, 5, 30, 0, 0]),
                 top_p=np.array([1, 0.9, 0.9, 1, 0.95, 1, 1, 1, 0.5, 1, 1, 0.8]),
                 min_p=np.array([0, 0, 0.05, 0, 0, 0, 0, 0.1, 0, 0, 0, 0.02]),
                 seeds=rng.integers(0, 2**31, r), num_logprobs=np.full(r, -1))
    t = tensors_for(rows, **extra)
    logits = rng.normal(0, 2, (r, v)).astype(np.float32)
    logits[11, rng.choice(v, 40, replace=False)] += 14  # peaked: top_p alone settles on the top 64
    pos, pen = rng.integers(0, 1000, r).astype(np.int32), penalties_for(rows, v)
    f = ALL.replace(num_logprobs=None, prompt_logprobs=False)
    fast = jax.jit(lambda x, t, p, pen: sample(x, t, p, f, pen))(logits, t, pos, pen).tokens
    ref_f = f.replace(top_k_top_p="sort")
    want = jax.jit(lambda x, t, p, pen: sample(x, t, p, ref_f, pen))(logits, t, pos, pen).tokens
    np.testing.assert_array_equal(fast, want)
    greedy = np.asarray(extra["temperature"]) == 0
    processed = np.stack([ref.process_row(logits[i], **rows[i]) for i in np.flatnonzero(greedy)])
    np.testing.assert_array_equal(np.asarray(fast)[greedy], np.argmax(processed, axis=-1))


def test_greedy_rows_take_argmax_of_processed_logits():
    rng = np.random.default_rng(5)
    r, v = 16, 200  # the shapes of the other whole-sampler tests: one compile
    rows, t = random_batch(rng, r, v)
    t = dataclasses.replace(t, temperature=np.zeros(r, np.float32))  # greedy; top_k / top_p must not matter
    logits = rng.normal(0, 2, (r, v)).astype(np.float32)
    tokens = run(ALL, logits, t, np.arange(r, dtype=np.int32), penalties_for(rows, v)).tokens
    want = [np.argmax(ref.process_row(logits[i], **rows[i])) for i in range(r)]
    np.testing.assert_array_equal(tokens, want)


@pytest.mark.parametrize("num_others", [1, 7, 64])
def test_seeded_row_is_batch_invariant(num_others):
    rng = np.random.default_rng(6)
    v = 150
    rows, t = random_batch(rng, num_others + 1, v)
    logits = rng.normal(0, 2, (num_others + 1, v)).astype(np.float32)
    pos = rng.integers(0, 500, num_others + 1).astype(np.int32)
    # Row 0 is the request under test: seeded, sampled, every feature on.
    t = jax.tree.map(np.array, t)  # edited and sliced on the host
    for name, value in dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seeds=4242, num_logprobs=5).items():
        getattr(t, name)[0] = value
    f = ALL.replace(runtime_skip=False)  # the quickest variant to compile with every feature
    pen = jax.tree.map(np.asarray, penalties_for(rows, v))
    t_alone = jax.tree.map(lambda a: a[:1], t)
    pen_alone = PenaltyData(pen.output_counts[:1], pen.prompt_mask[:1], np.zeros(1, np.int32))
    for step in range(3):  # a few positions of the same request
        p = pos + step
        batched = jax.tree.map(np.asarray, run(f, logits, t, p, pen))
        single = jax.tree.map(np.asarray, run(f, logits[:1], t_alone, p[:1], pen_alone))
        assert int(batched.tokens[0]) == int(single.tokens[0])
        np.testing.assert_array_equal(batched.logprob_token_ids[0], single.logprob_token_ids[0])
        # Values may differ in the last bit: the logsumexp reduction depends on the batch shape.
        np.testing.assert_allclose(batched.logprobs[0], single.logprobs[0], rtol=1e-6)


def test_noise_keys_are_unchanged():
    """(seed, position) -> noise is a compatibility promise: seeded outputs must not drift."""
    got = noise(np.array([1234, 0], np.int32), np.array([7, 0], np.int32), 6)
    # Values from the float64 numpy reference of the hash (as in the test below), 2026-11-30.
    np.testing.assert_allclose(got, [[1.01809951, -0.24014176, -0.49949522, -1.54605308, 1.07762704, 0.01217014],
                                       [1.08421633, 0.98342993, 0.79348211, 1.33712219, -1.23380572, 0.39527367]],
                               rtol=1e-5, atol=1e-6)
    logits = np.random.default_rng(7).normal(size=(4, 50)).astype(np.float32)
    temperature = np.array([0.0, 0.5, 1.0, 2.0], np.float32)
    seeds, pos = np.array([1, 2, 3, 4], np.int32), np.array([10, 20, 30, 40], np.int32)

    @jax.jit
    def noisy_argmax(logits, temperature, seeds, pos):
        want = jnp.argmax(logits / jnp.maximum(temperature, 1e-6)[:, None] + gumbel_noise(seeds, pos, 50), -1)
        return jnp.where(temperature > 0, want, jnp.argmax(logits, -1))

    want = noisy_argmax(logits, temperature, seeds, pos)
    np.testing.assert_array_equal(jax.jit(sample_tokens)(logits, temperature, seeds, pos), want)


# --- logprobs ---------------------------------------------------------------------------------

def test_logprobs_and_ranks_match_log_softmax_of_raw_logits():
    rng = np.random.default_rng(8)
    r, v = 16, 200
    rows, t = random_batch(rng, r, v)
    logits = rng.normal(0, 3, (r, v)).astype(np.float32)
    logits[0, :5] = logits[0].max() + 1  # ties at the top
    out = run(ALL, logits, t, np.arange(r, dtype=np.int32), penalties_for(rows, v))
    want = ref.log_softmax(logits)
    tokens = np.asarray(out.tokens)
    ids, lps = np.asarray(out.logprob_token_ids), np.asarray(out.logprobs)
    assert ids.shape == (r, 21)
    for i in range(r):
        assert ids[i, 0] == tokens[i]
        np.testing.assert_allclose(lps[i], want[i, ids[i]], atol=1e-5)
        np.testing.assert_allclose(lps[i, 1:], np.sort(want[i])[::-1][:20], atol=1e-5)
        assert out.sampled_rank[i] == 1 + (logits[i] > logits[i, tokens[i]]).sum()
    no_logprobs = run(ALL.replace(num_logprobs=None), logits, t, np.arange(r, dtype=np.int32),
                      penalties_for(rows, v))
    assert no_logprobs.logprobs is None
    np.testing.assert_array_equal(no_logprobs.tokens, out.tokens)


@pytest.mark.parametrize("blocks", [(1,), (7,), (256,), (4096,), (128, 16), (64, 7, 2)])
def test_block_top_n_matches_top_k(blocks):
    rng = np.random.default_rng(9)
    x = rng.normal(size=(5, 5000)).astype(np.float32)
    x[0, 100:130] = 9.0  # more ties at the top than n, inside one block
    x[1, ::250] = 9.0  # ties at the top spread over blocks
    x[2] = np.round(x[2])  # ties everywhere
    x[3, 4990:] = 50.0  # the top in the last, partly padded block
    x[4, :] = -np.inf
    x[4, 4000:4003] = 1.0
    for n in (1, 3, 20):
        got, want = top_n(x, n, blocks=blocks), lax_top_k(x, n)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def _np_fmix32(h):
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def test_gumbel_noise_matches_numpy_and_is_gumbel():
    seeds, pos, v = np.array([1234, 0, 2**31 - 1]), np.array([7, 0, 99]), 20_000
    got = np.asarray(noise(seeds.astype(np.int32), pos.astype(np.int32), v))
    with np.errstate(over="ignore"):
        golden = np.uint32(0x9E3779B9)
        key = _np_fmix32(seeds.astype(np.uint32) ^ _np_fmix32(pos.astype(np.uint32) * golden + np.uint32(1)))
        ids = np.arange(v, dtype=np.uint32)
        bits = _np_fmix32(_np_fmix32(ids[None] * np.uint32(0x9E3779B9) ^ key[:, None]) + key[:, None])
    u = ((bits >> np.uint32(9)).astype(np.float64) + 0.5) / 2**23
    np.testing.assert_allclose(got, -np.log(-np.log(u)), rtol=1e-5, atol=1e-5)
    for row in got:  # each row is a standard Gumbel sample
        assert stats.kstest(row, stats.gumbel_r.cdf).pvalue > 1e-3
    assert abs(np.corrcoef(got[0], got[1])[0, 1]) < 0.05  # rows (seeds / positions) independent


def test_the_sampler_holds_no_conditional_but_the_greedy_skip():
    """The every-feature sampler runs its whole-row passes without a conditional (on GPUs a
    conditional inside the step costs far more than its microbenchmark: features.py), and so
    does plain sampling; only temperature-only sampling with runtime skips keeps one, which
    skips the noise for a batch of greedy rows. Counted in the lowered program, so it holds on
    any backend (the jnp passes: interpreted kernels add conditionals of their own)."""
    r, v = 4, 9000
    t = SamplingTensors.neutral(r)
    pen = penalty_data_from_tokens([[1]] * r, [[2]] * r, v)
    x, pos = jnp.zeros((r, v), jnp.float32), jnp.zeros((r,), jnp.int32)
    text = jax.jit(lambda x, t, p, pen: sample(x, t, p, ALL, pen)).lower(x, t, pos, pen).as_text()
    assert "stablehlo.case" not in text
    for features, cases in ((SamplerFeatures.plain_sampling(), 0), (SamplerFeatures(), 1)):
        text = jax.jit(lambda x, t, p, f=features: sample(x, t, p, f)).lower(x, t, pos).as_text()
        assert text.count("stablehlo.case") == cases
