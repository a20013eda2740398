"""The device side of structured outputs: an automaton copied into the pool at an offset, the
mask it puts on logits and the state step, against the host tables' own walk."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrv2_jax.engine.tokenizer import load_tokenizer
from mrv2_jax.models.loader import CHECKPOINTS_DIR
from mrv2_jax.sample import automata
from mrv2_jax.structured.compiler import ConstraintCompiler
from mrv2_jax.structured.params import StructuredOutputsParams

EOS, V = 0, 2048
# The jnp functions under test as one program each (op by op, every op compiles its own).
mask_logits = jax.jit(automata.mask_logits, static_argnums=3)
advance = jax.jit(automata.advance)


@pytest.fixture(scope="module")
def loaded():
    """An automaton at state 70 / exception 5000 of a pool, written in several pieces."""
    compiler = ConstraintCompiler(load_tokenizer(CHECKPOINTS_DIR / "demo-qwen3"), (EOS,), V)
    automaton = compiler.compile(StructuredOutputsParams(regex=r"([a-z]{1,6}[,.] ){1,9}(yes|no)"))
    tables = jax.jit(automata.init_tables, static_argnums=(0, 1, 2))(automaton.num_states + 100,
                                                                   automaton.num_exceptions + 6000, V)
    tables = automata.AutomatonWriter(tables).write(tables, automaton, 70, 5000)
    return automaton, tables


def test_mask_allows_exactly_the_state_tokens(loaded):
    automaton, tables = loaded
    n = automaton.num_states
    states = np.concatenate([np.arange(n) + 70, [-1]]).astype(np.int32)
    logits = np.random.default_rng(0).normal(size=(n + 1, V)).astype(jnp.bfloat16)
    masked = np.asarray(mask_logits(logits, tables, states, EOS), np.float32)
    logits = logits.astype(np.float32)
    for s in range(n):
        allowed = np.isfinite(masked[s])
        assert np.flatnonzero(allowed).tolist() == automaton.allowed_tokens(s).tolist()
        np.testing.assert_array_equal(masked[s][allowed], logits[s][allowed])
    np.testing.assert_array_equal(masked[n], logits[n])  # unconstrained row untouched


def test_a_state_that_allows_nothing_gets_eos(loaded):
    _, tables = loaded
    empty = np.int32(tables.allowed.shape[0] - 1)  # a pool state nobody wrote
    masked = mask_logits(np.zeros((1, V), np.float32), tables, empty[None], EOS)
    assert np.flatnonzero(np.isfinite(np.asarray(masked[0]))).tolist() == [EOS]


def test_advance_matches_the_host_walk_for_every_allowed_token(loaded):
    automaton, tables = loaded
    pairs = [(s, t) for s in range(automaton.num_states) for t in automaton.allowed_tokens(s)]
    states = np.array([s + 70 for s, _ in pairs] + [-1], np.int32)
    tokens = np.array([t for _, t in pairs] + [5], np.int32)
    got = np.asarray(advance(tables, states, tokens))
    assert got.tolist() == [automaton.next_state(s, int(t)) + 70 for s, t in pairs] + [-1]
    assert automaton.num_states > automata.WRITE_STATES and automaton.num_exceptions > automata.WRITE_EXCEPTIONS
