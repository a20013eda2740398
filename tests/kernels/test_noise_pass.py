"""The whole-row noise pass (pallas_kernels/noise_pass.py, mrv2_jax/sample/noise_pass.py): the
jnp reference against numpy, the Pallas kernel (interpreted on the CPU, compiled with -m gpu)
against the reference, and the sampler with the kernel against the sampler with the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrv2_jax.sample.features import SamplerKernels
from mrv2_jax.sample.gumbel import gumbel_noise
from pallas_kernels import noise_pass as kernel
from tests.kernels.test_logit_stats import every_feature_case
from tests.triton_lowering import verify_triton_lowering

# As one program each (op by op, every op would compile its own).
noise_pass_reference = jax.jit(kernel.noise_pass_reference)


def random_rows(rng, r, v):
    x = rng.normal(0, 3, (r, v)).astype(np.float32)
    x[1] = -np.inf  # a fully masked row
    x[2, 7:11] = x[2].max() + 1  # ties at the top
    divisor = rng.uniform(0.3, 2, r).astype(np.float32)
    keep_from = np.where(rng.random(r) < 0.5, -np.inf, rng.normal(1, 1, r)).astype(np.float32)
    is_sampled = np.arange(r) % 4 != 3  # every fourth row greedy
    seeds, positions = rng.integers(0, 2**31, r), rng.integers(0, 4096, r)
    return [jax.device_put(a) for a in (x, divisor, keep_from, seeds.astype(np.int32), positions.astype(np.int32),
                                     is_sampled)]


def test_reference_is_argmax_of_noisy_row():
    """The reference against numpy, with the noise from gumbel.py (tested on its own)."""
    rng = np.random.default_rng(1)
    x, divisor, keep_from, seeds, positions, is_sampled = random_rows(rng, 8, 1000)
    got = np.asarray(noise_pass_reference(x, divisor, keep_from, seeds, positions, is_sampled))
    xs = np.asarray(x)
    scaled = xs / np.asarray(divisor)[:, None]
    noisy = np.where(scaled >= np.asarray(keep_from)[:, None], scaled, -np.inf) + np.asarray(
        jax.jit(gumbel_noise, static_argnums=2)(seeds, positions, 1000))
    want = np.where(np.asarray(is_sampled), np.argmax(noisy, axis=1), np.argmax(xs, axis=1))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("v", [1000, 4 * 4096 + 77])
def test_kernel_matches_reference_at_needed_rows(v):
    rng = np.random.default_rng(2)
    rows = random_rows(rng, 8, v)
    needed = jax.device_put(np.array([True, True, True, False, True, False, True, True]))
    got = np.asarray(kernel.noise_pass(*rows, needed, interpret=True))
    np.testing.assert_array_equal(got, noise_pass_reference(*rows, needed))
    want = np.asarray(noise_pass_reference(*rows))
    np.testing.assert_array_equal(got[np.asarray(needed)], want[np.asarray(needed)])
    assert not got[~np.asarray(needed)].any()


def test_sampler_with_the_noise_kernel_matches():
    """Every feature on, rows that the top candidates do not settle included (top_k 200, flat
    top_p): the same tokens and logprobs with the pass as the kernel (interpreted, reading only
    the rows that need it) as with the reference over every row."""
    logits, t, data, step = every_feature_case()
    want = step(logits, t, data)
    got = step(logits, t, data, kernels=SamplerKernels(noise_pass="interpret"))
    for name in ("tokens", "logprob_token_ids", "sampled_rank"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)


def test_kernel_lowers_to_triton(monkeypatch):
    verified = verify_triton_lowering(monkeypatch)
    S = jax.ShapeDtypeStruct
    r, v = 256, 151936
    f32, i32 = jnp.float32, jnp.int32
    text = jax.jit(kernel.noise_pass).trace(S((r, v), f32), S((r,), f32), S((r,), f32), S((r,), i32), S((r,), i32),
                                            S((r,), bool), S((r,), bool)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert verified == [True]


@pytest.mark.gpu
def test_gpu_kernel_matches_reference_at_serving_shape():
    rng = np.random.default_rng(3)
    rows = random_rows(rng, 256, 151936)
    needed = jnp.asarray(rng.random(256) < 0.5)
    got = np.asarray(kernel.noise_pass(*rows, needed))
    want = np.asarray(jax.jit(kernel.noise_pass_reference)(*rows))
    np.testing.assert_array_equal(got[np.asarray(needed)], want[np.asarray(needed)])

