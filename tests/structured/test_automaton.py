"""Compiled automata against independent references: outlines-core's own index walked in plain
Python (allowed tokens and next states of every reachable state), `re.fullmatch` on the texts
the automaton accepts, and the pruning of states that cannot finish."""

import re

import numpy as np
import pytest
from outlines_core import Index, Vocabulary

from mrv2_jax.engine.tokenizer import load_tokenizer
from mrv2_jax.models.loader import CHECKPOINTS_DIR
from mrv2_jax.structured.automaton import _live_states, compile_automaton
from mrv2_jax.structured.compiler import ConstraintCompiler
from mrv2_jax.structured.params import StructuredOutputsParams
from mrv2_jax.structured.vocabulary import token_bytes

EOS = 0  # the demo tokenizer's <|endoftext|>
V = 2048


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(CHECKPOINTS_DIR / "demo-qwen3")


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return ConstraintCompiler(tokenizer, (EOS,), V)


CONSTRAINTS = [StructuredOutputsParams(regex=r"[A-Z][a-z]{1,4}( [a-z]{1,3}){1,2}\."),
               StructuredOutputsParams(choice=["yes", "no", "Romeo and Juliet"]),
               StructuredOutputsParams(json={"type": "object", "properties": {
                   "name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}}, "required": ["name", "ok"]})]


@pytest.mark.parametrize("params", CONSTRAINTS, ids=lambda p: p.kind)
def test_tables_agree_with_outlines_index(compiler, params):
    automaton = compiler.compile(params)
    vocab = compiler.vocabulary
    index = Index(params.pattern, Vocabulary(EOS, vocab.tokens))
    # Walk both side by side over every state: the same allowed tokens, the same successors.
    ours, theirs, seen = [automaton.start], [index.get_initial_state()], set()
    while ours:
        s, t = ours.pop(), theirs.pop()
        if s in seen:
            continue
        seen.add(s)
        expected = sorted(index.get_allowed_tokens(t))
        assert automaton.allowed_tokens(s).tolist() == expected
        assert automaton.final[s] == index.is_final_state(t)
        for token in expected:
            # The ids as `allowed_tokens` hands them out (NumPy int32) step the same way.
            assert automaton.next_state(s, np.int32(token)) == automaton.next_state(s, token)
            if token != EOS:
                ours.append(automaton.next_state(s, token))
                theirs.append(index.get_next_state(t, token))
            else:
                assert automaton.next_state(s, token) == s
    assert len(seen) == automaton.num_states


def test_choices_walk_to_final_states_and_nothing_else_does(compiler, tokenizer):
    automaton = compiler.compile(CONSTRAINTS[1])
    for text in ("yes", "no", "Romeo and Juliet"):
        assert automaton.final[automaton.walk(tokenizer.encode(text))]
    state = automaton.walk(tokenizer.encode("Romeo"))
    assert not automaton.final[state] and not automaton.is_allowed(state, EOS)
    with pytest.raises(ValueError, match="not allowed"):
        automaton.walk(tokenizer.encode("maybe"))


def test_random_walks_accept_only_matching_texts(compiler, tokenizer):
    rng = np.random.default_rng(0)
    params = CONSTRAINTS[0]
    automaton = compiler.compile(params)
    for _ in range(30):
        state, out = automaton.start, []
        while True:
            token = int(rng.choice(automaton.allowed_tokens(state)))
            if token == EOS:
                break
            out.append(token)
            state = automaton.next_state(state, token)
        assert re.fullmatch(params.pattern, tokenizer.decode(out)), tokenizer.decode(out)


def test_cache_returns_one_automaton_per_constraint(compiler):
    a = compiler.compile(StructuredOutputsParams(regex="(ab|cd)+"))
    assert compiler.compile(StructuredOutputsParams(regex="(ab|cd)+")) is a
    assert a.nbytes == a.num_states * (8 * V // 32 + 8) + 4 * a.num_exceptions


def test_unsatisfiable_constraints_are_rejected(compiler):
    with pytest.raises(ValueError, match="structured_outputs.regex: the constraint cannot be compiled"):
        compiler.compile(StructuredOutputsParams(regex=r"[^\s\S]"))
    with pytest.raises(ValueError, match="structured_outputs.regex: the constraint cannot be compiled"):
        compiler.compile(StructuredOutputsParams(regex=r"(a)\1"))  # a back reference: not a finite automaton


def test_dead_ends_are_pruned():
    # 0 -a-> 1 (final), 0 -b-> 2 -c-> 3 -> nowhere: 2 and 3 never finish.
    transitions = {0: {10: 1, 11: 2}, 2: {12: 3}}
    assert _live_states(0, transitions, {1}) == [0, 1]
    assert _live_states(2, transitions, {1}) == []


def test_vocabulary_spelling():
    assert token_bytes("Ġthe", None) == b" the"  # byte-level BPE
    assert token_bytes("<0x0A>", None) == b"\n"
    assert token_bytes("▁the", lambda t: " the") == b" the"  # anything else: its text


def test_missing_eos_is_an_error(compiler):
    vocab = compiler.vocabulary
    no_eos = type(vocab)(vocab.tokens, (), V, "x")
    with pytest.raises(ValueError, match="EOS"):
        compile_automaton("a", no_eos)
