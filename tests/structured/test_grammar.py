"""Grammars through llguidance on the host (structured/grammar.py), on the demo tokenizer: the
bitmask of a grammar equals, token by token, the `allowed` words of the device automaton that
outlines-core builds from an equivalent regex (an independent implementation), EOS included
exactly where the output is complete; GBNF works as Lark does; bad grammars fail naming the
field; a grammar's matcher is its request's own."""

import random
import re

import numpy as np
import pytest

from mrv2_jax.engine import core_messages as M
from mrv2_jax.engine.tokenizer import load_tokenizer
from mrv2_jax.runner.automaton_pool import AutomatonPool
from mrv2_jax.sampling_params import SamplingParams
from mrv2_jax.structured.compiler import ConstraintCompiler
from mrv2_jax.structured.params import StructuredOutputsParams
from tests.structured.grammar_cases import DEMO, GBNF, LARK, REGEX

EOS = 0


@pytest.fixture(scope="module")
def compiler():
    return ConstraintCompiler(load_tokenizer(DEMO), [EOS], 2048)


def allowed(words) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(np.asarray(words, np.uint32).view(np.uint8), bitorder="little")).tolist())


@pytest.mark.parametrize("grammar", [LARK, GBNF], ids=["lark", "gbnf"])
def test_masks_equal_the_regex_automaton_along_random_paths(compiler, grammar):
    automaton = compiler.compile(StructuredOutputsParams(regex=REGEX))
    rng = random.Random(0)
    texts = []
    for _ in range(12):
        matcher = compiler.compile(StructuredOutputsParams(grammar=grammar))
        state, tokens = automaton.start, []
        while True:
            mask = allowed(matcher.mask())
            assert mask == set(automaton.allowed_tokens(state).tolist()), (tokens, state)
            assert (EOS in mask) == bool(automaton.final[state]) == matcher.accepting
            token = rng.choice(sorted(mask))
            if token == EOS:
                break
            assert matcher.consume(token)
            state, tokens = automaton.next_state(state, token), tokens + [token]
        texts.append(compiler._tokenizer.decode(tokens))
    assert all(re.fullmatch(REGEX, text) for text in texts), texts


def test_bad_grammars_name_the_field(compiler):
    for bad, why in (("start: (", "invalid grammar"), ("", "non-empty string"), (5, "non-empty string"),
                     ("root ::= [0-9", "from GBNF to Lark")):
        with pytest.raises(ValueError, match=f"structured_outputs.grammar: .*{why}"):
            SamplingParams(structured_outputs={"grammar": bad})
    # Valid, but the first token it allows is EOS where the output is incomplete: nothing satisfies it.
    with pytest.raises(ValueError, match="structured_outputs.grammar: no output of this tokenizer satisfies"):
        compiler.compile(StructuredOutputsParams(grammar='start: <[0]> "a"'))


def test_each_request_gets_its_own_matcher_and_pool_state(compiler):
    params = StructuredOutputsParams(grammar=LARK)
    first, second = compiler.compile(params), compiler.compile(params)
    assert first is not second and compiler.cached(params) is not None
    assert first.consume(next(iter(allowed(first.mask()) - {EOS})))
    assert allowed(second.mask()) == allowed(compiler.compile(params).mask()) != allowed(first.mask())
    pool = AutomatonPool(4, 4)
    assert pool.reserve("a", first) and pool.reserve("b", second)
    assert pool.acquire("a", first)[0] != pool.acquire("b", second)[0]
    pool.release("a")
    pool.release("b")
    assert pool.num_users == pool.num_loaded == 0  # a grammar's state never outlives its request


def test_grammar_survives_the_engine_wire_format():
    params = SamplingParams(max_tokens=5, structured_outputs=dict(grammar=GBNF))
    frame = M.encoder().encode(M.AddRequest("r", [1, 2], params, False))
    back = M.to_engine_decoder().decode(frame).params.structured_outputs
    assert back == params.structured_outputs and back.key == params.structured_outputs.key
    assert back.kind == "grammar"
