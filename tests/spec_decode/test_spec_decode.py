"""Speculative decoding in the engines: greedy outputs with speculation equal those without,
for each proposer and k, in v2-sync, v2-async and v1, over a mixed batch with chunked prefill,
preemption, stop strings and stop tokens; acceptance where it must be; the pipeline stays
asynchronous; no compiles after warm-up (MRV2_STRICT_COMPILES=1 turns any into an error).

Uses the embedded demo pair (checkpoints/demo-qwen3, checkpoints/demo-qwen3-draft). Engines
are built once per configuration (module cache) and reused, v2-sync and v2-async on one engine.
Spec steps with the greedy, plain and `all` sampler variants meet the reference (SAMPLING_ENGINES, PLAIN_ENGINES).
"""

import functools
import json

import jax
import pytest

from mrv2_jax.llm import LLM
from mrv2_jax.models.loader import CHECKPOINTS_DIR
from mrv2_jax.runner import v2
from mrv2_jax.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("no_persistent_compile_cache")  # conftest.py says why

DRAFT = str(CHECKPOINTS_DIR / "demo-qwen3-draft")
TARGET = str(CHECKPOINTS_DIR / "demo-qwen3")
# A small KV pool (20 blocks of 4; one request may need 16) forces preemptions; a 16-token
# budget chunks the longer prompts. One bucket size: every step pads to 16 tokens, so each engine
# compiles one program set (buckets are the runner's tests' concern; this keeps the suite short).
ENGINE_ARGS = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                   num_gpu_blocks=20, block_size=4, show_progress=False, bucket_token_sizes=(16,))

PROMPTS = ["ROMEO:\n", "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind",
           "KING HENRY:\nOnce more unto the breach, dear friends, once more;", "First Citizen:\n",
           "the the the the the the the the", "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
           "HAMLET:\nAlas, poor Yorick! I knew him, Horatio:", "MACBETH:\nTomorrow, and tomorrow, and tomorrow,"]


def _key(spec):
    return json.dumps(spec, sort_keys=True) if isinstance(spec, dict) else spec


# The engines that sampled or logprobs batches run too (the tests below share them with the greedy
# ones) compile `all` alone, which serves both. Every other engine here but PLAIN_ENGINES' runs greedy
# batches only and lists the greedy sampler variant first: it compiles in about a third of `all`'s
# time, and `all` stays listed (compiled only if a batch needs it).
SAMPLING_ENGINES = {
    ("v2", None),
    ("v2", _key({"method": "ngram", "k": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})),
    ("v2", _key({"method": "draft_model", "k": 3, "model": DRAFT})),
    ("v1", _key({"method": "ngram", "k": 2})),
}
# The draft-equals-target engine runs greedy and temperature-only (seeded) rows alone: the plain
# sampling variant covers those batches and compiles in about two thirds of `all`'s time.
PLAIN_ENGINES = {
    ("v2", _key({"method": "draft_model", "k": 3, "model": TARGET, "rejection_sampling": "probabilistic"})),
}


def engine(runner="v2", spec=None) -> LLM:
    return _engine(runner, _key(spec))


@functools.cache
def _engine(runner, spec) -> LLM:
    if (runner, spec) in SAMPLING_ENGINES:
        variants = "all"
    else:
        variants = "plain,all" if (runner, spec) in PLAIN_ENGINES else "greedy,all"
    # The reference (no speculation) runs one decode step per call, as the speculating engines must:
    # its fused-decode program would be one more compile, and the fused path has its own tests.
    fused = dict(max_fused_steps=1) if spec is None else {}
    return LLM("demo", runner=runner, async_scheduling=runner == "v2", speculative_config=spec,
               sampler_variants=variants, **ENGINE_ARGS, **fused)


def run(llm, params, async_scheduling=None, prompts=PROMPTS):
    if async_scheduling is not None:
        # The scheduler runs the same code in both modes; only the engine loop differs, and it
        # holds no step in flight between two generate() calls.
        llm.engine.async_scheduling = async_scheduling
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]


@functools.cache
def reference():
    """Greedy outputs without speculation, with stop strings taken from the outputs themselves."""
    llm = engine()
    plain = run(llm, [SamplingParams(max_tokens=10 + 3 * (i % 5), temperature=0.0) for i in range(len(PROMPTS))])
    params = []
    for i, (_, _, text) in enumerate(plain):
        stop = [text[6:9]] if i % 3 == 0 and len(text.strip()) > 12 and text[6:9].strip() else None
        params.append(SamplingParams(max_tokens=10 + 3 * (i % 5), temperature=0.0, stop=stop,
                                     stop_token_ids=[plain[i][0][4]] if i % 4 == 1 else None))
    expected = run(llm, params)
    assert any(reason == "stop" for _, reason, _ in expected)
    return params, expected


def check_equal(spec, runner="v2"):
    params, expected = reference()
    llm = engine(runner, spec)
    modes = (False, True) if runner == "v2" else (None,)
    for mode in modes:
        assert run(llm, params, mode) == expected, (spec, runner, mode)
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0
    assert scheduler.get_stats().spec_decode.num_drafts > 0
    assert llm.engine.compile_guard.num_unexpected == 0
    return llm


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_greedy_outputs_unchanged(k):
    check_equal({"method": "ngram", "k": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3})


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_model_greedy_outputs_unchanged(k):
    llm = check_equal({"method": "draft_model", "k": k, "model": DRAFT})
    assert llm.engine.scheduler.get_stats().spec_decode.num_accepted_tokens > 0


@pytest.mark.parametrize("spec", [{"method": "draft_model", "k": 3, "model": DRAFT},
                                  {"method": "ngram", "k": 2}], ids=["draft", "ngram"])
def test_v1_runner_with_spec_decode(spec):
    check_equal(spec, runner="v1")


def test_ngram_on_repetitive_text_accepts_drafts():
    llm = engine("v2", {"method": "ngram", "k": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    before = llm.engine.scheduler.get_stats().spec_decode.num_accepted_tokens
    prompts = ["the the the the the the the the the", "and so and so and so and so and so"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert run(llm, params, prompts=prompts) == run(engine(), params, prompts=prompts)
    assert llm.engine.scheduler.get_stats().spec_decode.num_accepted_tokens > before


def test_draft_equal_to_target_accepts_everything():
    """Probabilistic verification: greedy rows (one-hot p and q) and sampled rows (p == q) both
    accept every draft."""
    llm = engine("v2", {"method": "draft_model", "k": 3, "model": TARGET, "rejection_sampling": "probabilistic"})
    params = [SamplingParams(max_tokens=16, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    outs = run(llm, params)
    stats = llm.engine.scheduler.get_stats().spec_decode
    assert stats.num_draft_tokens > 50 and stats.acceptance_rate >= 0.98, stats
    greedy = [o for o, p in zip(outs, params) if p.temperature == 0.0]
    assert greedy == [o for o, p in zip(run(engine(), params), params) if p.temperature == 0.0]


def test_strict_seeded_sampling_is_unchanged_by_speculation():
    """Strict verification emits the target's own (seed, position) samples."""
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_k=40, seed=100 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    spec = engine("v2", {"method": "draft_model", "k": 3, "model": DRAFT})
    assert run(spec, params) == run(engine(), params)


def test_synthetic_acceptance_rate():
    llm = engine("v2", {"method": "synthetic", "k": 3, "acceptance_rate": 0.6})
    outs = run(llm, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    assert all(len(tokens) == 30 for tokens, _, _ in outs)
    stats = llm.engine.scheduler.get_stats().spec_decode
    # Per-draft acceptance given the earlier drafts were kept: position 1 is kept 60% of the time.
    assert 0.45 < stats.per_position_acceptance[0] < 0.75, stats


def test_async_pipeline_with_spec_decode(monkeypatch):
    """No device->host transfer while a step is prepared and dispatched, and step n's tokens are
    read only after step n + 1 was dispatched, or after a schedule with nothing to run: near
    max_tokens a row's in-flight drafts count as outputs, so it may have to wait for them."""
    llm = engine("v2", {"method": "draft_model", "k": 3, "model": DRAFT})
    llm.engine.async_scheduling = True
    events, runner = [], llm.engine.runner
    real_execute, real_result = runner.execute, v2.PendingStep.result
    count = [0]

    def execute(out):
        with jax.transfer_guard_device_to_host("disallow"):
            pending = real_execute(out)
        if isinstance(pending, v2.PendingStep):
            pending.step_number = count[0]
            events.append(("dispatch", count[0]))
            count[0] += 1
        else:
            events.append(("empty", count[0]))
        return pending

    def result(self):
        events.append(("read", self.step_number))
        return real_result(self)

    monkeypatch.setattr(runner, "execute", execute)
    monkeypatch.setattr(v2.PendingStep, "result", result)
    run(llm, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    reads = [n for kind, n in events if kind == "read"]
    assert len(reads) > 5
    for n in reads:
        read_at = events.index(("read", n))
        assert ("dispatch", n + 1) in events[:read_at] or ("empty", n + 1) in events[:read_at]


def test_spec_decode_outputs_are_strings_too():
    """Multi-token steps stream through the detokenizer like single tokens."""
    llm = engine("v2", {"method": "draft_model", "k": 3, "model": DRAFT})
    chunks = [o.delta_text for o in llm.stream(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0))]
    full = engine().generate(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
    assert "".join(chunks) == full[0].outputs[0].text and len(chunks) > 1


def test_prompt_logprobs_are_rejected_with_speculative_decoding():
    """Spec steps compute no prompt logprobs: such a request is refused at add_request, never
    silently served without them."""
    llm = engine("v2", {"method": "ngram", "k": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.add_request(PROMPTS[0], SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert not llm.engine.has_work()


@pytest.mark.parametrize("runner, spec", [
    ("v2", {"method": "ngram", "k": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
    ("v1", {"method": "ngram", "k": 2})], ids=["v2", "v1"])
def test_structured_outputs_are_rejected_with_speculative_decoding(runner, spec):
    """A spec step verifies drafts without an automaton (and V1 runs none): a constrained request
    is refused at add_request with a message that says why, never served unconstrained."""
    llm = engine(runner, spec)
    for constraint in ({"choice": ["a", "b"]}, {"grammar": 'start: "a" | "b"'}):
        with pytest.raises(ValueError, match=r"structured_outputs is not supported .*speculative decoding"):
            llm.add_request(PROMPTS[0], SamplingParams(max_tokens=2, structured_outputs=constraint))
    assert not llm.engine.has_work()


@pytest.mark.parametrize("runner, spec", [
    ("v2", {"method": "ngram", "k": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
    ("v1", {"method": "ngram", "k": 2})], ids=["v2", "v1"])
def test_logprobs_beside_speculating_rows(runner, spec):
    """Rows asking for logprobs get no drafts; their logprobs come out of the spec step as out
    of a plain one, while the other rows of the batch speculate."""
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2 if i % 2 else None)
              for i in range(len(PROMPTS))]
    llm = engine(runner, spec)
    drafts_before = llm.engine.scheduler.get_stats().spec_decode.num_drafts
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.scheduler.get_stats().spec_decode.num_drafts > drafts_before
    for out, want, p in zip(outs, engine().generate(PROMPTS, params, use_tqdm=False), params):
        got, want = out.outputs[0], want.outputs[0]
        assert got.token_ids == want.token_ids
        if p.logprobs is None:
            assert got.logprobs is None
            continue
        assert len(got.logprobs) == len(got.token_ids)
        for a, b in zip(got.logprobs, want.logprobs):
            assert list(a) == list(b) and [x.rank for x in a.values()] == [x.rank for x in b.values()]
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
