"""Structured outputs on the device: a pool of token automata, the mask they put on a row's
logits, and the step from one state to the next with the sampled token.

The pool holds the compact tables of every automaton in use (mrv2_jax/structured/automaton.py
explains the layout), all states of all automata in one id space: a request's automaton is
copied in once when it arrives (`AutomatonWriter`, a small precompiled dispatch, off the step
path) and each slot keeps its current global state id (-1: unconstrained) among its sampler
scalars. Inside the step a constrained row's logits outside its state's allowed bits become
-inf before sampling, and the sampled token moves the row to its next state: a gather by state
and a popcount, no host involvement, so it also runs inside the fused decode loop.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

WRITE_STATES = 64  # states per write dispatch
WRITE_EXCEPTIONS = 4096  # exception entries per write dispatch


class AutomatonTables(NamedTuple):
    allowed: jax.Array  # u32[P, W]: bit t of state s set if token t may come next
    exception: jax.Array  # u32[P, W]: bit t set if token t does not lead to default_next
    default_next: jax.Array  # i32[P]: global id of the state most tokens lead to
    first_exception: jax.Array  # i32[P]: the state's first entry in exception_next
    exception_next: jax.Array  # i32[E]: global next state of each exception, in token order


def init_tables(num_states: int, num_exceptions: int, vocab_size: int) -> AutomatonTables:
    w = -(-vocab_size // 32)
    return AutomatonTables(jnp.zeros((num_states, w), jnp.uint32), jnp.zeros((num_states, w), jnp.uint32),
                           jnp.zeros((num_states,), jnp.int32), jnp.zeros((num_states,), jnp.int32),
                           jnp.zeros((num_exceptions,), jnp.int32))


def write(tables: AutomatonTables, state_at, allowed, exception, default_next, first_exception, exception_at,
          exception_next) -> AutomatonTables:
    """Store states at global ids `state_at` and exception entries at `exception_at` (-1: skip)."""
    p, e = tables.default_next.shape[0], tables.exception_next.shape[0]
    s = jnp.where(state_at >= 0, state_at, p)
    x = jnp.where(exception_at >= 0, exception_at, e)
    return AutomatonTables(tables.allowed.at[s].set(allowed, mode="drop"),
                           tables.exception.at[s].set(exception, mode="drop"),
                           tables.default_next.at[s].set(default_next, mode="drop"),
                           tables.first_exception.at[s].set(first_exception, mode="drop"),
                           tables.exception_next.at[x].set(exception_next, mode="drop"))


def write_allowed(tables: AutomatonTables, state_at, allowed) -> AutomatonTables:
    """Replace the `allowed` words of the states at global ids `state_at` (-1: skip): a grammar's
    one state gets the host's bitmask before each step (runner/grammar_masks.py)."""
    s = jnp.where(state_at >= 0, state_at, tables.allowed.shape[0])
    return tables._replace(allowed=tables.allowed.at[s].set(allowed, mode="drop"))


def mask_logits(logits: jax.Array, tables: AutomatonTables, states: jax.Array, eos_token_id: int) -> jax.Array:
    """logits [R, V] with every token a constrained row's state (states i32[R], -1: none) does not
    allow set to -inf. A state that allows nothing (never built: compile prunes dead ends) gets
    EOS, so the request ends instead of sampling from nothing."""
    r, v = logits.shape
    words = tables.allowed[jnp.maximum(states, 0)]
    eos_words = jnp.zeros(words.shape[1], jnp.uint32).at[eos_token_id >> 5].set(np.uint32(1 << (eos_token_id & 31)))
    words = jnp.where(jnp.any(words != 0, axis=-1, keepdims=True), words, eos_words)
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    allowed = bits.reshape(r, -1)[:, :v].astype(bool) | (states < 0)[:, None]
    return jnp.where(allowed, logits, jnp.asarray(-jnp.inf, logits.dtype))


def advance(tables: AutomatonTables, states: jax.Array, tokens: jax.Array) -> jax.Array:
    """i32[R]: each constrained row's state after its sampled token (unconstrained rows keep -1).
    An exception's entry is first_exception + the exception bits below the token (popcount)."""
    s = jnp.maximum(states, 0)
    word, bit = tokens >> 5, (tokens & 31).astype(jnp.uint32)
    ex = tables.exception[s]  # [R, W]
    ex_word = jnp.take_along_axis(ex, word[:, None], axis=1)[:, 0]
    counts = jax.lax.population_count(ex).astype(jnp.int32)
    below = jnp.sum(jnp.where(jnp.arange(ex.shape[1]) < word[:, None], counts, 0), axis=-1)
    below += jax.lax.population_count(ex_word & ((jnp.uint32(1) << bit) - 1)).astype(jnp.int32)
    is_exception = ((ex_word >> bit) & 1) == 1
    e = tables.exception_next.shape[0]
    via_exception = tables.exception_next[jnp.clip(tables.first_exception[s] + below, 0, e - 1)]
    nxt = jnp.where(is_exception, via_exception, tables.default_next[s])
    return jnp.where(states >= 0, nxt, states)


class AutomatonWriter:
    """Host side: copies one automaton into the pool at (state base, exception base) with one
    precompiled function, in fixed-size pieces (no compile later)."""

    def __init__(self, tables: AutomatonTables):
        w = tables.allowed.shape[1]
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        u32 = jax.ShapeDtypeStruct((WRITE_STATES, w), jnp.uint32)
        self._write = jax.jit(write, donate_argnums=(0,)).lower(
            tables, i32(WRITE_STATES), u32, u32, i32(WRITE_STATES), i32(WRITE_STATES), i32(WRITE_EXCEPTIONS),
            i32(WRITE_EXCEPTIONS)).compile()
        self._w = w

    def write(self, tables: AutomatonTables, automaton, state_base: int, exception_base: int) -> AutomatonTables:
        """`automaton`: a structured.automaton.TokenAutomaton; its local ids become global ones."""
        n, e = automaton.num_states, automaton.num_exceptions
        default_next = automaton.default_next + state_base
        first_exception = automaton.first_exception + exception_base
        exception_next = automaton.exception_next + state_base
        pieces = max(-(-n // WRITE_STATES), -(-e // WRITE_EXCEPTIONS), 1)
        for k in range(pieces):
            lo, hi = k * WRITE_STATES, min((k + 1) * WRITE_STATES, n)
            at = np.full(WRITE_STATES, -1, np.int32)
            allowed = np.zeros((WRITE_STATES, self._w), np.uint32)
            exception = np.zeros((WRITE_STATES, self._w), np.uint32)
            dn = np.zeros(WRITE_STATES, np.int32)
            fe = np.zeros(WRITE_STATES, np.int32)
            if lo < hi:
                at[: hi - lo] = np.arange(lo, hi) + state_base
                allowed[: hi - lo] = automaton.allowed[lo:hi]
                exception[: hi - lo] = automaton.exception[lo:hi]
                dn[: hi - lo] = default_next[lo:hi]
                fe[: hi - lo] = first_exception[lo:hi]
            elo, ehi = k * WRITE_EXCEPTIONS, min((k + 1) * WRITE_EXCEPTIONS, e)
            eat = np.full(WRITE_EXCEPTIONS, -1, np.int32)
            en = np.zeros(WRITE_EXCEPTIONS, np.int32)
            if elo < ehi:
                eat[: ehi - elo] = np.arange(elo, ehi) + exception_base
                en[: ehi - elo] = exception_next[elo:ehi]
            tables = self._write(tables, at, allowed, exception, dn, fe, eat, en)
        return tables
