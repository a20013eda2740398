"""Structured outputs through the real engine (demo model, V2 runner, async scheduling, fused
decode up to 4 steps, a KV pool small enough to preempt): every constrained output matches its
regex / is one of the choices / parses and validates against its schema, greedy and seeded; the
tokens are a path of the automaton walked in plain Python; one step per call (streaming caps
fused decode at 1) and fused calls give the same tokens; unconstrained rows of a mixed batch are
those of a run without the constrained ones; preemption resumes the automaton where it was.
(A sampled json_object may spend max_tokens inside a free-text string: then its tokens must be a
valid prefix.)"""

import json
import re

import jsonschema
import pytest

from mrv2_jax.llm import LLM
from mrv2_jax.sampling_params import SamplingParams
from mrv2_jax.structured.params import StructuredOutputsParams
from tests.structured.grammar_cases import STRUCTURED_ENGINE_ARGS

PROMPTS = ["The king said", "ROMEO:\n", "To be, or not", "JULIET:\nO Romeo", "First Citizen:\n",
           "HAMLET:\nAlas, poor Yorick!", "Speak, my lord", "MACBETH:\n"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "king": {"type": "boolean"},
                                           "mood": {"enum": ["merry", "sad", "wroth"]}},
          "required": ["name", "king", "mood"]}
REGEX = r"[A-Z][a-z]{1,6}( [a-z]{1,6}){1,4}[.!?]"
CHOICES = ["yes", "no", "my lord", "Romeo"]


def check_regex(text):
    assert re.fullmatch(REGEX, text), text


def check_choice(text):
    assert text in CHOICES, text


def check_schema(text):
    jsonschema.validate(json.loads(text), SCHEMA)


def check_object(text):
    assert isinstance(json.loads(text), dict), text


CONSTRAINTS = {"regex": (dict(regex=REGEX), check_regex), "choice": (dict(choice=CHOICES), check_choice),
               "json": (dict(json=SCHEMA), check_schema), "json_object": (dict(json_object=True), check_object)}


@pytest.fixture(scope="module")
def llm():
    return LLM("demo", **STRUCTURED_ENGINE_ARGS)


def constrained(kind, i, seeded):
    sampling = dict(temperature=0.8, seed=100 + i) if seeded else dict(temperature=0.0)
    return SamplingParams(max_tokens=64, structured_outputs=CONSTRAINTS[kind][0], **sampling)


def run(llm, prompts, params, streaming=False):
    """Final outputs in input order; `streaming` caps fused decode at one step per call."""
    ids = [llm.add_request(p, sp, final_only=True, streaming=streaming) for p, sp in zip(prompts, params)]
    final = {out.request_id: out for out in llm._run(ids) if out.finished}
    return [final[i].outputs[0] for i in ids]


def check_outputs(llm, outs, params):
    for out, sp in zip(outs, params):
        if sp.structured_outputs is None:
            continue
        automaton = llm.engine.compiler.compile(sp.structured_outputs)
        if out.finish_reason == "length" and sp.structured_outputs.kind == "json_object" and not sp.is_greedy:
            automaton.walk(out.token_ids)  # a sampled free-text string may outrun max_tokens: a valid prefix
            continue
        assert out.finish_reason == "stop", (out.text, out.finish_reason)
        CONSTRAINTS[sp.structured_outputs.kind][1](out.text)
        # Independent of the device: the tokens walk the automaton to a final state, ending on EOS.
        *body, eos = out.token_ids
        assert eos in llm.model_state.eos_token_ids
        assert automaton.is_allowed(automaton.walk(body), eos)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_every_constraint_fused_and_one_step_per_call(llm, seeded):
    kinds = list(CONSTRAINTS) * 2
    params = [constrained(kind, i, seeded) for i, kind in enumerate(kinds)]
    prompts = PROMPTS[: len(params)]
    runner = llm.engine.runner
    calls = runner.num_fused_calls
    stepped = run(llm, prompts, params, streaming=True)
    assert runner.num_fused_calls == calls
    fused = run(llm, prompts, params)
    assert runner.num_fused_calls > calls
    check_outputs(llm, fused, params)
    assert [o.token_ids for o in fused] == [o.token_ids for o in stepped]
    assert llm.engine.compile_guard.num_unexpected == 0


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_mixed_batch_leaves_unconstrained_rows_alone(llm, seeded):
    sampling = (lambda i: dict(temperature=0.9, seed=7 + i)) if seeded else (lambda i: dict(temperature=0.0))
    plain = [SamplingParams(max_tokens=24, **sampling(i)) for i in range(4)]
    alone = run(llm, PROMPTS[:4], plain)
    kinds = list(CONSTRAINTS)
    params = [p for i in range(4) for p in (plain[i], constrained(kinds[i], i, seeded))]
    prompts = [p for i in range(4) for p in (PROMPTS[i], PROMPTS[4 + i])]
    mixed = run(llm, prompts, params)
    assert [o.token_ids for o in mixed[::2]] == [o.token_ids for o in alone]
    check_outputs(llm, mixed, params)
    assert llm.engine.compiler.tokenizer is llm.tokenizer  # one tokenizer for detokenizing and constraints


def test_preemption_resumes_the_automaton(llm):
    params = [constrained(kind, i, seeded=False) for i, kind in enumerate(["json", "regex"] * 4)]
    one_by_one = [run(llm, [p], [sp])[0] for p, sp in zip(PROMPTS, params)]
    before = llm.engine.scheduler.num_preemptions
    batch = run(llm, PROMPTS, params)
    assert llm.engine.scheduler.num_preemptions > before
    assert [o.token_ids for o in batch] == [o.token_ids for o in one_by_one]
    check_outputs(llm, batch, params)


def test_bad_constraints_fail_alone_and_the_engine_keeps_serving(llm):
    for bad, field in ((dict(regex=r"[^\s\S]"), "structured_outputs.regex"),
                       (dict(choice=[]), "structured_outputs.choice"),
                       (dict(json={"type": "object", "properties": 5}), "structured_outputs.json")):
        with pytest.raises(ValueError, match=re.escape(field)):
            llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=4), SamplingParams(structured_outputs=bad)],
                         use_tqdm=False)
    out = run(llm, PROMPTS[:1], [SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"]))])[0]
    assert out.text in ("yes", "no")
    assert run(llm, PROMPTS[:1], [SamplingParams(max_tokens=4, temperature=0.0)])[0].finish_reason == "length"


def test_a_pool_with_room_for_one_automaton_serves_requests_in_turn(monkeypatch):
    """Three requests with three constraints, and a device pool that holds one automaton at a
    time: the scheduler admits each when the pool has room (no failed step), and each output is
    the one that request gets alone in an engine with a large pool."""
    from mrv2_jax.structured.compiler import ConstraintCompiler

    kinds = [dict(choice=["yes", "no"]), dict(choice=["Romeo", "Juliet"]), dict(choice=["my lord", "my lady"])]
    params = [SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=kind) for kind in kinds]
    big = LLM("demo", **STRUCTURED_ENGINE_ARGS)
    alone = [run(big, [p], [sp])[0] for p, sp in zip(PROMPTS, params)]
    compiler = ConstraintCompiler(big.tokenizer, big.model_state.eos_token_ids, big.model_state.vocab_size)
    automata = [compiler.compile(StructuredOutputsParams(**kind)) for kind in kinds]
    # Room for the largest alone: any two together overflow its states.
    monkeypatch.setenv("MRV2_STRUCTURED_STATES", str(max(a.num_states for a in automata)))
    monkeypatch.setenv("MRV2_STRUCTURED_EXCEPTIONS", str(max(max(a.num_exceptions for a in automata), 1)))
    small = LLM("demo", **STRUCTURED_ENGINE_ARGS)
    assert small.engine.runner.automaton_capacity[0] < sum(sorted(a.num_states for a in automata)[:2])
    together = run(small, PROMPTS[:3], params)
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(o.finish_reason == "stop" and o.text in kind["choice"] for o, kind in zip(together, kinds))
