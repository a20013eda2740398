"""The threshold slow path (mrv2_jax/sample/slow_path.py): the Pallas kernels (interpreted on the
CPU, compiled with -m gpu) against the numpy reference's kept tokens and the jnp search, and the
sampler with them against the sampler with the jnp search."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrv2_jax.sample import topk_topp
from mrv2_jax.sample.features import SamplerKernels
from pallas_kernels import threshold_search as kernel
from tests import sampler_reference as ref
from tests.kernels.test_logit_stats import every_feature_case
from tests.triton_lowering import verify_triton_lowering


def search_case(rng, v, cases):
    """Rows of x with a divisor each, and per-row (min_p, top_k, top_p): top_p None draws a
    value away from rounding (sampler_reference.safe_top_p) on the tokens min_p and top_k keep."""
    r = len(cases)
    x = rng.normal(0, 3, (r, v)).astype(np.float32)
    x[1] = np.round(x[1])  # ties everywhere
    x[2, rng.choice(v, 50, replace=False)] = x[2].max() + 1  # 50 tied at the top
    x[3, :v // 2] = -np.inf  # half the row masked (logit_bias, min_tokens)
    divisor = rng.uniform(0.4, 2, r).astype(np.float32)
    # Divided as the kernels and the sampler do (XLA's CPU division can differ from numpy's by an ulp).
    scaled = np.asarray(jax.jit(lambda x, d: x / d[:, None])(x, divisor))
    min_p, k, p = (np.array(c, np.float64) for c in zip(*cases))
    for i, (mp, ki, pi) in enumerate(cases):
        if pi is None:
            p[i] = ref.safe_top_p(scaled[i], ref.kept_tokens(scaled[i], min_p=mp, top_k=int(ki)), rng)
    floor = np.asarray(jax.jit(topk_topp.min_p_threshold)(scaled.max(1), min_p.astype(np.float32)))
    return x, divisor, scaled, floor, min_p, k.astype(np.int32), p.astype(np.float32)


CASES = [(0.0, 300, 1.0), (0.0, 7, None), (0.0, 40, 1.0), (0.0, 0, None), (0.05, 0, None), (0.0, 2999, 1.0),
         (0.02, 500, None), (0.0, 1, 1.0), (0.0, 0, 1.0), (0.1, 3000, 0.5)]


@pytest.mark.parametrize("v", [3000, 2 * 4096 + 77])
def test_kernel_keeps_the_reference_tokens(v):
    """At the needed rows, the kept tokens (scaled >= threshold) are the numpy reference's:
    top_k exact with ties kept together, top_p after top_k over the tokens above the floor;
    other rows get their floor."""
    rng = np.random.default_rng(4)
    x, divisor, scaled, floor, min_p, k, p = search_case(rng, v, CASES)
    needed = np.arange(len(CASES)) != 8
    got = np.asarray(kernel.threshold_search(x, divisor, scaled.max(1), floor, k, p, needed, interpret=True))
    for i in np.flatnonzero(needed):
        want = ref.kept_tokens(scaled[i], min_p=min_p[i], top_k=int(k[i]), top_p=float(p[i]))
        np.testing.assert_array_equal(scaled[i] >= got[i], want, err_msg=f"row {i}: {CASES[i]}")
    np.testing.assert_array_equal(got[~needed], floor[~needed])


def test_kernel_matches_the_jnp_search():
    """The same thresholds as topk_topp's searches: bit for bit for top_k (exact counts), and
    for top_p on these rows (the sums' orders differ, the cut-offs are away from rounding)."""
    rng = np.random.default_rng(5)
    x, divisor, scaled, floor, _, k, p = search_case(rng, 3000, CASES)
    want = jax.jit(topk_topp.top_k_top_p_threshold_search)(scaled, floor, k, p)
    needed = np.ones(len(CASES), bool)
    got = kernel.threshold_search(x, divisor, scaled.max(1), floor, k, p, needed, interpret=True)
    np.testing.assert_array_equal(got, want)


def test_row_mass_kernel_matches_reference():
    rng = np.random.default_rng(6)
    x, divisor, scaled, floor, *_ = search_case(rng, 5000, CASES)
    needed = np.arange(len(CASES)) % 3 != 0
    got = np.asarray(kernel.row_mass(x, divisor, scaled.max(1), floor, needed, interpret=True))
    s = np.asarray(scaled, np.float64)
    want = np.where(s >= floor[:, None], np.exp(s - s.max(1, keepdims=True)), 0).sum(1)
    np.testing.assert_allclose(got[needed], want[needed], rtol=1e-5)
    assert not got[~needed].any()
    jnp_mass = np.asarray(jax.jit(kernel.row_mass_reference)(x, divisor, scaled.max(1), floor, needed))
    np.testing.assert_allclose(jnp_mass[needed], want[needed], rtol=1e-5)
    assert not jnp_mass[~needed].any()


def test_sampler_with_the_search_kernels_matches():
    """Every feature on, rows that take the slow path included (top_k 200, flat top_p, min_p
    with top_p): the same tokens and logprobs with the slow path as kernels (interpreted), alone
    and with the noise pass's kernel, as with the jnp searches."""
    logits, t, data, step = every_feature_case()
    want = step(logits, t, data)
    for noise in ("reference", "interpret"):
        got = step(logits, t, data, kernels=SamplerKernels(noise_pass=noise, slow_path="interpret"))
        for name in ("tokens", "logprob_token_ids", "sampled_rank", "logprobs"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=f"{name}, noise {noise}")


def test_kernels_lower_to_triton(monkeypatch):
    verified = verify_triton_lowering(monkeypatch)
    S = jax.ShapeDtypeStruct
    r, v = 256, 151936
    f32, i32 = jnp.float32, jnp.int32
    rows = S((r,), f32)
    search = jax.jit(kernel.threshold_search).trace(S((r, v), f32), rows, rows, rows, S((r,), i32), rows,
                                                     S((r,), bool)).lower(lowering_platforms=("cuda",)).as_text()
    mass = jax.jit(kernel.row_mass).trace(S((r, v), f32), rows, rows, rows, S((r,), bool)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert search.count("__gpu$xla.gpu.triton") == mass.count("__gpu$xla.gpu.triton") == 1
    assert verified == [True, True]


@pytest.mark.gpu
def test_gpu_kernels_match_the_jnp_search_at_serving_width():
    """(The numpy reference's top_p is quadratic in V: too slow at 151,936.)"""
    rng = np.random.default_rng(7)
    x, divisor, scaled, floor, _, k, p = search_case(rng, 151936, CASES)
    needed = np.ones(len(CASES), bool)
    got = kernel.threshold_search(x, divisor, scaled.max(1), floor, k, p, needed)
    np.testing.assert_array_equal(got, jax.jit(topk_topp.top_k_top_p_threshold_search)(scaled, floor, k, p))
    mass = kernel.row_mass(x, divisor, scaled.max(1), floor, needed)
    want = jax.jit(kernel.row_mass_reference)(x, divisor, scaled.max(1), floor, needed)
    np.testing.assert_allclose(mass, want, rtol=1e-5)


@pytest.mark.gpu
def test_gpu_sampler_with_kernels_matches_the_jnp_passes_at_serving_width():
    """The sampler compiled for the GPU with both whole-row passes as kernels (the default
    there) gives the same tokens and logprobs as with the jnp passes, at V 151,936 on rows that
    take the slow path and the whole-row noise pass."""
    logits, t, data, step = every_feature_case(v=151936)
    outs = {mode: step(logits, t, data, kernels=SamplerKernels("kernel", mode, mode))
            for mode in ("reference", "kernel")}
    for name in ("tokens", "logprob_token_ids", "sampled_rank", "logprobs"):
        np.testing.assert_array_equal(getattr(outs["kernel"], name), getattr(outs["reference"], name), err_msg=name)
