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


def test_reserve_waits_for_room_and_acquire_finds_the_place():
    """The scheduler's side: `has_room` and a failed `reserve` change nothing; the runner's
    `acquire` of a reserved request returns that place, copied in by its first user only."""
    pool = AutomatonPool(8, 100)
    a, b = automaton(6, 10), automaton(6, 10)
    assert pool.reserve("r1", a) and pool.reserve("r2", a)
    assert not pool.has_room("r3", b) and not pool.reserve("r3", b)  # a is in use and b does not fit beside it
    assert pool.acquire("r1", a) == (0, 0, True)  # placed by the reservation, copied by its first acquire
    assert pool.acquire("r2", a) == (0, 0, False)
    pool.release("r1")
    assert not pool.has_room("r3", b)  # r2 still uses a
    pool.release("r2")
    assert pool.has_room("r3", b) and pool.reserve("r3", b)  # a is idle now: dropped for b
    assert pool.acquire("r3", b) == (0, 0, True)
    assert pool.acquire("r3", b) == (0, 0, False)  # a second acquire of the same request copies nothing
