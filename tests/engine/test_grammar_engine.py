"""Grammars through the real engine (demo model, V2 runner, async scheduling, fused decode up to
4 steps, a KV pool small enough to preempt), each output checked without llguidance: a regex
(`re.fullmatch`) for a grammar that stands for one, a small parser for a nested one. The host
path (llguidance bitmask) and the device path (outlines-core automaton) give the same tokens for
one language; unconstrained rows beside grammar rows give the tokens they give alone; no call is
fused while a grammar runs; preemption, abort and finish leave the automaton pool empty; a grammar
that cannot go on ends with "error"."""

import re

import pytest

from mrv2_jax.llm import LLM
from mrv2_jax.sampling_params import SamplingParams
from tests.structured.grammar_cases import (
    GBNF,
    LARK,
    NESTED,
    REGEX,
    STRUCTURED_ENGINE_ARGS,
    WORDS_LARK,
    WORDS_REGEX,
    is_nested,
)

PROMPTS = ["The king said", "ROMEO:\n", "To be, or not", "JULIET:\nO Romeo", "First Citizen:\n",
           "HAMLET:\nAlas, poor Yorick!", "Speak, my lord", "MACBETH:\n"]
CHECKS = {"lark": (dict(grammar=LARK), lambda t: re.fullmatch(REGEX, t)),
          "gbnf": (dict(grammar=GBNF), lambda t: re.fullmatch(REGEX, t)),
          "nested": (dict(grammar=NESTED), is_nested),
          "regex": (dict(regex=REGEX), lambda t: re.fullmatch(REGEX, t))}


@pytest.fixture(scope="module")
def llm():
    """The engine, its runner checking at every step that a grammar request's mask is computed
    with every earlier token known: nothing of it in flight but this step's token, no fused call."""
    llm = LLM("demo", **STRUCTURED_ENGINE_ARGS)
    runner = llm.engine.runner
    execute = runner.execute

    def checked(out):
        for request in out.scheduled_requests.values():
            if request.grammar is not None:
                assert out.num_fused_steps == 1 and request.num_output_placeholders <= 1, request
        return execute(out)

    runner.execute = checked
    return llm


def sampling(i, seeded):
    return dict(temperature=0.8, seed=100 + i) if seeded else dict(temperature=0.0)


def run(llm, prompts, params):
    ids = [llm.add_request(p, sp, final_only=True) for p, sp in zip(prompts, params)]
    final = {out.request_id: out for out in llm._run(ids) if out.finished}
    return [final[i].outputs[0] for i in ids]


def assert_pool_empty(llm):
    """After one more (empty) step, in which the runner hears of the last finished requests."""
    llm.step()
    runner = llm.engine.runner
    assert runner.automaton_pool.num_users == 0 and not runner.grammar_masks
    assert all(entry.automaton.shared for entry in runner.automaton_pool._loaded.values())


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_mixed_batch(llm, seeded):
    """Grammar, device-path and unconstrained requests in one batch: every constrained output
    parses, and the unconstrained ones are those of a run alone (which fuses calls)."""
    runner = llm.engine.runner
    plain = [SamplingParams(max_tokens=24, **sampling(i, seeded)) for i in range(4)]
    fused_before = runner.num_fused_calls
    alone = run(llm, PROMPTS[:4], plain)
    assert runner.num_fused_calls > fused_before  # (so the mixed run below could have fused)
    kinds = ["lark", "nested", "regex", "gbnf"]
    constrained = [SamplingParams(max_tokens=40, structured_outputs=CHECKS[k][0], **sampling(i, seeded))
                   for i, k in enumerate(kinds)]
    params = [p for pair in zip(plain, constrained) for p in pair]
    prompts = [p for i in range(4) for p in (PROMPTS[i], PROMPTS[4 + i])]
    mixed = run(llm, prompts, params)
    assert [o.token_ids for o in mixed[::2]] == [o.token_ids for o in alone]
    for out, kind in zip(mixed[1::2], kinds):
        assert out.finish_reason == "stop" and CHECKS[kind][1](out.text), (kind, out.text, out.finish_reason)
        assert out.token_ids[-1] in llm.model_state.eos_token_ids
    assert llm.engine.compile_guard.num_unexpected == 0
    assert_pool_empty(llm)


def test_a_grammar_joins_running_requests(llm):
    """Added while unconstrained requests run with a step in flight (async): the grammar's first
    mask needs nothing in flight, and the engine turns synchronous from its next step on."""
    plain = [SamplingParams(max_tokens=30, temperature=0.0) for _ in range(3)]
    alone = run(llm, PROMPTS[:3], plain)
    ids = [llm.add_request(p, sp, final_only=True) for p, sp in zip(PROMPTS[:3], plain)]
    outputs = [out for _ in range(3) for out in llm.step()]
    assert llm.engine._in_flight is not None
    ids.append(llm.add_request(PROMPTS[3], SamplingParams(max_tokens=40, temperature=0.0,
                                                          structured_outputs=dict(grammar=NESTED))))
    final = {out.request_id: out.outputs[0] for out in [*outputs, *llm._run(ids)] if out.finished}
    assert [final[i].token_ids for i in ids[:3]] == [o.token_ids for o in alone]
    assert final[ids[3]].finish_reason == "stop" and is_nested(final[ids[3]].text), final[ids[3]]
    assert_pool_empty(llm)


def test_host_and_device_paths_agree_through_preemption(llm):
    """One language as a regex (device automaton) and as a grammar (host bitmask): the same tokens,
    greedy and seeded, in a batch that preempts (the matcher resumes where it was)."""
    params = lambda so: [SamplingParams(max_tokens=80, structured_outputs=so, **sampling(i, i % 2))  # noqa: E731
                         for i in range(len(PROMPTS))]
    device = run(llm, PROMPTS, params(dict(regex=WORDS_REGEX)))
    before = llm.engine.scheduler.num_preemptions
    host = run(llm, PROMPTS, params(dict(grammar=WORDS_LARK)))
    assert llm.engine.scheduler.num_preemptions > before
    assert [o.token_ids for o in host] == [o.token_ids for o in device]
    assert all(o.finish_reason == "stop" and re.fullmatch(WORDS_REGEX, o.text) for o in host), [o.text for o in host]
    assert_pool_empty(llm)


def test_abort_releases_the_pool_state(llm):
    ids = [llm.add_request(p, SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=dict(grammar=NESTED)))
           for p in PROMPTS[:2]]
    while llm.engine.runner.automaton_pool.num_users < 2:
        llm.step()
    llm.abort(ids)
    assert_pool_empty(llm)
    assert not llm.engine.has_work()


def test_grammars_that_cannot_go_on_end_with_error(llm):
    """EOS is part of the first grammar before its end, so nothing can complete it; the second
    never ends, and llguidance gives up on it. Both end at once, and the engine goes on."""
    for grammar in ('start: "a" <[0]> "b"', 'start: a\na: "x" a'):
        out = run(llm, PROMPTS[:1], [SamplingParams(max_tokens=60, temperature=0.0,
                                                    structured_outputs=dict(grammar=grammar))])[0]
        assert out.finish_reason == "error" and len(out.token_ids) <= 2, (grammar, out)
        assert out.stop_reason.startswith("structured_outputs.grammar: ")
    with pytest.raises(ValueError, match="structured_outputs.grammar: invalid grammar"):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=dict(grammar="start: (")), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.grammar: no output of this tokenizer satisfies"):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=dict(grammar='start: <[0]> "a"')), use_tqdm=False)
    assert not llm.engine.has_work()
    assert run(llm, PROMPTS[:1], [SamplingParams(max_tokens=4, temperature=0.0)])[0].finish_reason == "length"
    assert_pool_empty(llm)
