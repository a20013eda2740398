"""The host bookkeeping of the device automaton pool: shared copies, reuse, eviction of idle
automata only, and a clear error when running requests fill it."""

from types import SimpleNamespace

import pytest

from mrv2_jax.runner.automaton_pool import AutomatonPool


def automaton(states, exceptions):
    return SimpleNamespace(num_states=states, num_exceptions=exceptions)


def test_shared_reused_and_evicted_when_idle():
    pool = AutomatonPool(10, 100)
    a, b, c = automaton(4, 40), automaton(4, 40), automaton(4, 40)
    assert pool.acquire("r1", a) == (0, 0, True)
    assert pool.acquire("r2", a) == (0, 0, False)  # same constraint: one copy
    assert pool.acquire("r3", b) == (4, 40, True)
    pool.release("r1")
    pool.release("r2")
    assert pool.acquire("r4", a) == (0, 0, False)  # idle but still loaded
    pool.release("r4")
    assert pool.acquire("r5", c) == (0, 0, True)  # needs room: a (idle) goes
    with pytest.raises(RuntimeError, match="MRV2_STRUCTURED_STATES"):
        pool.acquire("r6", automaton(4, 10))  # b and c are in use
    pool.release("r5")
    assert pool.acquire("r7", automaton(4, 10))[2]
