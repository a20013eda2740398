"""Every sampling parameter through the real engine (all three runner arms, tiny Qwen3 fixture), against a
plain one-request loop over the dense forward pass and the numpy sampler reference."""

import collections

import jax.numpy as jnp
import numpy as np
import pytest

from mrv2_jax.runner import v1
from mrv2_jax.sample import SamplerFeatures
from mrv2_jax.sampling_params import SamplingParams
from tests import sampler_reference as ref
from tests.engine.test_engine import MODEL, make_llm, random_prompts
from tests.engine_reference import PAD_TO, _dense_forward

EOS = 2


ARMS = {"v1": dict(runner="v1"), "v2-sync": dict(runner="v2", async_scheduling=False),
        "v2-async": dict(runner="v2", async_scheduling=True)}


@pytest.fixture(scope="module", params=list(ARMS))
def llm(request):
    # 26 blocks of 4 tokens: a dozen long requests at once get preempted and resumed. The widest sampler
    # variant alone (the single runtime-skipping program): the tests mix greedy and sampled batches.
    return make_llm(num_gpu_blocks=26, sampler_variants="all", **ARMS[request.param])


def dense_logits(seq):
    ids = np.zeros(PAD_TO, np.int32)
    ids[: len(seq)] = seq
    return np.asarray(_dense_forward(str(MODEL))(jnp.asarray(ids), len(seq)), np.float64)


def greedy_reference(prompt, max_tokens, params: SamplingParams):
    """Greedy decoding with bias / min_tokens / penalties applied by the numpy reference."""
    out = []
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS})
    while len(out) < max_tokens:
        x = ref.process_row(dense_logits(prompt + out), bias=params.logit_bias, stop_ids=sorted(stops),
                            min_tokens=params.min_tokens, num_output=len(out), prompt=prompt, output=out,
                            rep=params.repetition_penalty, pres=params.presence_penalty,
                            freq=params.frequency_penalty)
        out.append(int(np.argmax(x)))
        if out[-1] in stops and len(out) >= params.min_tokens:
            break
    return out


def test_penalties_match_reference_through_preemption(llm):
    prompts = random_prompts(12, seed=11, lo=20, hi=40)
    settings = [dict(repetition_penalty=1.8), dict(presence_penalty=1.5), dict(frequency_penalty=0.7),
                dict(repetition_penalty=0.6, frequency_penalty=-0.5, presence_penalty=0.4), {}]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **settings[i % len(settings)])
              for i in range(len(prompts))]
    before = llm.engine.scheduler.num_preemptions
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > before  # resumed requests rebuild their counts
    for prompt, p, out in zip(prompts, params, outs):
        assert out.outputs[0].token_ids == greedy_reference(prompt, 16, p), p


def test_logit_bias_and_min_tokens(llm):
    prompt = random_prompts(1, seed=12, lo=10, hi=11)[0]
    forced = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                   logit_bias={17: 100.0}), use_tqdm=False)[0]
    assert forced.outputs[0].token_ids == [17] * 5
    # EOS forced by a bias is held back by min_tokens, then ends the request at once.
    eos = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, min_tokens=4,
                                                logit_bias={EOS: 50.0}), use_tqdm=False)[0].outputs[0]
    assert len(eos.token_ids) == 5 and EOS not in eos.token_ids[:4] and eos.token_ids[4] == EOS
    assert eos.finish_reason == "stop"
    # A stop token that greedy decoding would emit first is masked for min_tokens outputs.
    first = greedy_reference(prompt, 1, SamplingParams(ignore_eos=True))[0]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, min_tokens=3,
                            stop_token_ids=[first], logit_bias={first: 3.0})
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert first not in out.token_ids[:3]
    assert out.token_ids == greedy_reference(prompt, 10, params)


def test_logprobs_are_raw_log_softmax_with_ranks(llm):
    prompts = random_prompts(3, seed=13, lo=5, hi=20)
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=6, temperature=1.5, top_k=5, seed=5, ignore_eos=True, logprobs=0,
                             repetition_penalty=1.5),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[2].outputs[0].logprobs is None
    for prompt, p, out in zip(prompts[:2], params[:2], outs[:2]):
        tokens, logprobs = out.outputs[0].token_ids, out.outputs[0].logprobs
        assert len(logprobs) == len(tokens)
        for i, (token, entry) in enumerate(zip(tokens, logprobs)):
            want = ref.log_softmax(dense_logits(prompt + tokens[:i]))
            top = np.argsort(-want)[: p.logprobs].tolist()
            assert next(iter(entry)) == token and set(entry) == {token, *top}
            for t in entry:
                assert entry[t].logprob == pytest.approx(want[t], abs=1e-4)
            assert entry[token].rank == 1 + (want > want[token] + 1e-6).sum()
            assert [entry[t].rank for t in top if t != token] == [j + 1 for j, t in enumerate(top) if t != token]


def test_seeded_sampling_with_every_feature_is_batch_invariant(llm):
    prompt = random_prompts(1, seed=14)[0]
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=10, top_p=0.9, min_p=0.05,
                            repetition_penalty=1.2, frequency_penalty=0.3, logit_bias={30: 1.0},
                            seed=99, logprobs=2, ignore_eos=True)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    others = random_prompts(5, seed=15)
    other_params = [SamplingParams(max_tokens=8, temperature=t, top_p=0.8, presence_penalty=0.5, seed=i)
                    for i, t in enumerate([0.0, 1.0, 0.5, 1.2, 0.0])]
    batch = llm.generate(others[:2] + [prompt] + others[2:], other_params[:2] + [params] + other_params[2:],
                         use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone.token_ids
    for a, b in zip(alone.logprobs, batch[2].outputs[0].logprobs):
        assert a.keys() == b.keys()
        assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)


def test_static_sampler_variants_give_the_same_outputs(llm, monkeypatch):
    """A runner compiled with a greedy/temperature-only variant plus a full one (no runtime
    skips) picks per step and agrees with the single runtime-skipping variant. Its variants find
    the top_k / top_p cut-offs by the threshold method (the GPUs' default), the module's engines
    by one sort per row (the CPU's): the two methods give the same tokens through the engine."""
    variants = (SamplerFeatures(), SamplerFeatures.all(runtime_skip=False))

    class StaticVariants(v1.ModelRunnerV1):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **(kwargs | {"sampler_variants": variants}))

    monkeypatch.setattr(v1, "ModelRunnerV1", StaticVariants)
    static = make_llm(num_gpu_blocks=26, max_num_batched_tokens=8)  # one bucket: a quick compile
    assert isinstance(static.engine.runner, StaticVariants)
    assert static.engine.runner.sampler_variants[-1].top_k_top_p == "threshold"
    assert llm.engine.runner.sampler_variants[-1].top_k_top_p == "sort"
    prompts = random_prompts(4, seed=16)
    plain = [SamplingParams(max_tokens=6, temperature=t, seed=3, ignore_eos=True) for t in (0.0, 1.0)]
    fancy = [SamplingParams(max_tokens=6, temperature=0.8, top_p=0.7, presence_penalty=1.0, seed=4,
                            logprobs=1, ignore_eos=True), plain[0]]
    for params in (plain + plain, fancy + plain):
        a = [o.outputs[0] for o in static.generate(prompts, params, use_tqdm=False)]
        b = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert [o.token_ids for o in a] == [o.token_ids for o in b]


def count_variant_calls(runner):
    """Wrap every compiled step of a V2 runner: counts calls per sampler variant index."""
    used = collections.Counter()
    for table in (runner.compiled, runner.fused):
        for _, variants in table.values():
            for i, fn in enumerate(variants):
                variants[i] = (lambda fn, i: lambda *args: (used.update([i]), fn(*args))[1])(fn, i)
    return used


def test_plain_sampling_batches_take_the_variant_without_conditionals():
    """Variants greedy / plain / all (the GPU default): a batch that only samples with a temperature runs
    the plain variant, whose program has no conditional (no host round trip per step); a row
    with a truncation switches the step to the full variant; tokens equal a runner compiled
    with greedy and all only."""
    # Eager: the test reads every variant's program text and wraps the compiled programs.
    quick = dict(runner="v2", num_gpu_blocks=26, max_num_batched_tokens=8, max_fused_steps=1, compile_mode="eager")
    three = make_llm(**quick, sampler_variants="greedy,plain,all")
    two = make_llm(**quick, sampler_variants="greedy,all")
    runner = three.engine.runner
    # Every sampler piece in jnp here (CPU): the engine's truncation is one sort per row.
    assert runner.sampler_variants == tuple(f.replace(top_k_top_p="sort") for f in (
        SamplerFeatures.greedy(), SamplerFeatures.plain_sampling(), SamplerFeatures.all()))
    programs = [fn.as_text() for fn in next(iter(runner.compiled.values()))[1]]
    assert "conditional(" not in programs[1] and "conditional(" in programs[2]
    used = count_variant_calls(runner)
    prompts = random_prompts(4, seed=21)
    plain = [SamplingParams(max_tokens=6, temperature=t, seed=5 + i, ignore_eos=True)
             for i, t in enumerate((0.0, 1.0, 0.7, 0.0))]
    truncated = plain[:3] + [SamplingParams(max_tokens=6, temperature=0.8, top_p=0.5, seed=9, ignore_eos=True)]
    for params, variant in ((plain, 1), (truncated, 2)):
        used.clear()
        a = [o.outputs[0].token_ids for o in three.generate(prompts, params, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
        assert a == b
        assert max(used) == variant and used[variant] > 0


def test_sampler_variant_names_are_checked():
    from mrv2_jax.sample.features import default_variant_names, variants_by_name

    assert default_variant_names("gpu") == ("greedy", "plain", "full", "all")
    assert default_variant_names("cpu") == ("greedy", "all")

    assert variants_by_name("plain, all") == (SamplerFeatures.plain_sampling(), SamplerFeatures.all())
    full = variants_by_name("greedy,full,all")[1]
    assert full == SamplerFeatures.all(prompt_logprobs=False, structured=False) and SamplerFeatures.all().covers(full)
    structured = variants_by_name("structured,all")[0]
    assert structured == SamplerFeatures.plain_sampling().replace(structured=True)
    assert not full.covers(structured) and SamplerFeatures.all().covers(structured)
    for bad in ("greedy", "greedy,fast,all", "all,greedy", "all,all", ""):
        with pytest.raises(ValueError, match="sampler variants"):
            variants_by_name(bad)
