"""SamplingParams.prompt_logprobs through the real engine (v1, v2 sync and async), against a
dense full-prompt forward pass: chunked prefill, prefix caching on."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrv2_jax.models.loader import load_model
from mrv2_jax.sampling_params import SamplingParams
from tests import sampler_reference as ref
from tests.engine.test_engine import MODEL, make_llm, random_prompts
from tests.engine_reference import PAD_TO

ARMS = {"v1": dict(runner="v1"), "v2-sync": dict(runner="v2", async_scheduling=False),
        "v2-async": dict(runner="v2", async_scheduling=True)}


@functools.cache
def _all_logits():
    _, lm, _ = load_model(str(MODEL), dtype="float32")

    @jax.jit
    def logits(ids, length):
        segment = (jnp.arange(PAD_TO) >= length).astype(jnp.int32)
        return lm.forward_dense(ids, jnp.arange(PAD_TO, dtype=jnp.int32), segment)

    return logits


def dense_log_softmax(prompt):
    ids = np.zeros(PAD_TO, np.int32)
    ids[: len(prompt)] = prompt
    logits = np.asarray(_all_logits()(jnp.asarray(ids), len(prompt)), np.float64)[: len(prompt)]
    return np.stack([ref.log_softmax(row) for row in logits])


def check_prompt_logprobs(prompt, n, got):
    assert len(got) == len(prompt) and got[0] is None
    want = dense_log_softmax(prompt)
    for i in range(1, len(prompt)):
        entry, row, token = got[i], want[i - 1], prompt[i]
        top = np.argsort(-row, kind="stable")[:n].tolist()
        assert next(iter(entry)) == token and set(entry) == {token, *top}
        for t in entry:
            assert entry[t].logprob == pytest.approx(row[t], abs=1e-5)
        assert entry[token].rank == 1 + (row > row[token] + 1e-6).sum()
        assert [entry[t].rank for t in top if t != token] == [j + 1 for j, t in enumerate(top) if t != token]


@pytest.fixture(scope="module", params=list(ARMS))
def llm(request):
    # 8 tokens per step: every prompt is prefilled in several chunks.
    return make_llm(max_num_batched_tokens=8, enable_prefix_caching=True, **ARMS[request.param])


def test_prompt_logprobs_match_dense_forward_across_chunks(llm):
    prompts = random_prompts(3, seed=21, lo=12, hi=30)
    params = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=3),
              SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=0, logprobs=2),
              SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[2].prompt_logprobs is None
    for prompt, p, out in zip(prompts[:2], params[:2], outs[:2]):
        check_prompt_logprobs(prompt, p.prompt_logprobs, out.prompt_logprobs)
    assert outs[1].outputs[0].logprobs is not None and len(outs[1].outputs[0].logprobs) == 3


def test_prefix_cache_is_skipped_for_prompt_logprobs(llm):
    prompt = random_prompts(1, seed=22, lo=20, hi=30)[0]
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    asks = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    first = llm.generate([prompt], plain, use_tqdm=False)[0]
    again = llm.generate([prompt], plain, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the cache is on
    for _ in range(2):  # an identical request after a cached one, twice
        out = llm.generate([prompt], asks, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        check_prompt_logprobs(prompt, 2, out.prompt_logprobs)
        assert out.outputs[0].token_ids == first.outputs[0].token_ids


def test_single_token_prompt(llm):
    out = llm.generate([[5]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


def test_chunked_prompt_logprobs_equal_one_pass():
    """Past PROMPT_LOGPROBS_CHUNK tokens the logits are computed piece by piece: same result."""
    from mrv2_jax.runner import model_step

    class Head:
        w = jax.random.normal(jax.random.PRNGKey(0), (16, 300), jnp.float32)

        def compute_logits(self, h, dtype=jnp.float32):
            return h @ self.w

    t = 2 * model_step.PROMPT_LOGPROBS_CHUNK
    hidden = jax.random.normal(jax.random.PRNGKey(1), (t, 16), jnp.float32)
    targets = jnp.asarray(np.random.default_rng(0).integers(0, 301, t), jnp.int32)
    got = model_step.prompt_logprobs(Head(), hidden, targets)
    want = jax.nn.log_softmax(hidden @ Head.w, axis=-1)
    rows = np.flatnonzero(np.asarray(targets) > 0)
    np.testing.assert_allclose(np.asarray(got.logprobs)[rows, 0],
                               np.asarray(want)[rows, np.asarray(targets)[rows] - 1], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.token_ids)[:, 1:],
                                  np.asarray(jax.lax.top_k(want, model_step.PROMPT_LOGPROBS_TOP)[1]))
    skipped = model_step.prompt_logprobs(Head(), hidden, jnp.zeros(t, jnp.int32))
    assert not np.asarray(skipped.logprobs).any()


@pytest.mark.parametrize("arm", ["v1", "v2-async"])
def test_prompt_logprobs_survive_preemption(arm):
    """A small KV pool preempts requests mid-prefill and after it: each request still gets one
    entry per prompt token, equal to the dense forward's."""
    llm = make_llm(max_num_batched_tokens=8, max_model_len=48, num_gpu_blocks=12, **ARMS[arm])
    prompts = random_prompts(5, seed=23, lo=20, hi=34)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        check_prompt_logprobs(prompt, 2, out.prompt_logprobs)
    assert not llm.engine._prompt_logprobs


@pytest.mark.parametrize("arm", ["v1", "v2-async"])
def test_full_variant_runs_the_steps_without_prompt_logprobs(arm):
    """With `full` (every feature but prompt logprobs) before `all`, a request that uses sampler
    features decodes on `full`, prompt-logprob steps still run `all`, and every output equals
    the one with the default variants."""
    from mrv2_jax.sample.tensors import sampling_row

    prompts = random_prompts(3, seed=31, lo=12, hi=24)
    params = [SamplingParams(max_tokens=6, temperature=0.8, top_k=5, seed=7, logprobs=2, presence_penalty=0.5,
                             ignore_eos=True, prompt_logprobs=p) for p in (2, None, 1)]
    outs = {}
    for variants in ("greedy,all", "greedy,full,all"):
        llm = make_llm(max_num_batched_tokens=8, sampler_variants=variants, **ARMS[arm])
        outs[variants] = llm.generate(prompts, params, use_tqdm=False)
        if arm == "v2-async":
            assert llm.engine.runner._smallest_variant(sampling_row(params[1])) == variants.split(",").index(
                "full" if "full" in variants else "all")
    for want, got in zip(outs["greedy,all"], outs["greedy,full,all"]):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == want.outputs[0].logprobs
        assert got.prompt_logprobs == want.prompt_logprobs
    for prompt, out, p in zip(prompts, outs["greedy,full,all"], params):
        if p.prompt_logprobs:
            check_prompt_logprobs(prompt, p.prompt_logprobs, out.prompt_logprobs)
