"""Host bookkeeping of the device's automaton pool (sample/automata.py): which automata are
loaded at which state and exception offsets, and which requests use them.

Requests with the same constraint share one copy (the compile cache hands out one automaton
object per constraint). An automaton no request uses stays loaded, and is dropped (least
recently used first) only when a new one needs its room. A grammar's one-state automaton
(structured/grammar.py, `shared` False) belongs to its request alone and is dropped when the
request releases it.

The scheduler reserves a request's place when it admits the request (`reserve`), and keeps the
request waiting while the automata of running requests leave no room, so a full pool delays a
request instead of failing a step; the runner then finds the place reserved (`acquire`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _Loaded:
    automaton: object
    state_base: int
    exception_base: int
    users: int = 0


class AutomatonPool:
    def __init__(self, num_states: int, num_exceptions: int):
        self.num_states, self.num_exceptions = num_states, num_exceptions
        self._loaded: OrderedDict[int, _Loaded] = OrderedDict()  # id(automaton) -> where it is
        self._user_of: dict[str, int] = {}  # req_id -> id(automaton)
        self._unwritten: set[int] = set()  # placed, not yet copied to the device

    def reserve(self, req_id: str, automaton) -> bool:
        """Give `req_id` a place for `automaton` (its loaded copy, or room made by dropping idle
        automata); False, changing nothing, when the automata in use leave no room."""
        if req_id in self._user_of:
            return True
        key = id(automaton)
        entry = self._loaded.get(key)
        if entry is None:
            room = self._room_for(automaton)
            if room is None:
                return False
            state_base, exception_base, evicted = room
            for idle in evicted:
                del self._loaded[idle]
                self._unwritten.discard(idle)
            entry = self._loaded[key] = _Loaded(automaton, state_base, exception_base)
            self._unwritten.add(key)
        self._loaded.move_to_end(key)
        entry.users += 1
        self._user_of[req_id] = key
        return True

    def has_room(self, req_id: str, automaton) -> bool:
        """Whether `reserve` would succeed now (it changes nothing)."""
        return req_id in self._user_of or id(automaton) in self._loaded or self._room_for(automaton) is not None

    def acquire(self, req_id: str, automaton) -> tuple[int, int, bool]:
        """-> (state base, exception base, whether it must be copied in now); reserves the
        place first if the scheduler has not."""
        if not self.reserve(req_id, automaton):
            raise RuntimeError(
                "the device's automaton pool is full with the constraints of running requests; "
                "raise MRV2_STRUCTURED_STATES / MRV2_STRUCTURED_EXCEPTIONS")
        key = self._user_of[req_id]
        entry = self._loaded[key]
        fresh = key in self._unwritten
        self._unwritten.discard(key)
        return entry.state_base, entry.exception_base, fresh

    def release(self, req_id: str) -> None:
        key = self._user_of.pop(req_id, None)
        if key is not None:
            entry = self._loaded[key]
            entry.users -= 1
            if not entry.users and not getattr(entry.automaton, "shared", True):
                del self._loaded[key]
                self._unwritten.discard(key)

    @property
    def num_users(self) -> int:
        """Requests holding a place now."""
        return len(self._user_of)

    @property
    def num_loaded(self) -> int:
        """Automata in the pool, idle ones included."""
        return len(self._loaded)

    def _room_for(self, automaton) -> tuple[int, int, list[int]] | None:
        """(state base, exception base, idle automata to drop first, least recently used first)."""
        kept = list(self._loaded.items())
        evicted = []
        while True:
            s = _first_gap([(e.state_base, e.automaton.num_states) for _, e in kept],
                           automaton.num_states, self.num_states)
            x = _first_gap([(e.exception_base, e.automaton.num_exceptions) for _, e in kept],
                           automaton.num_exceptions, self.num_exceptions)
            if s is not None and x is not None:
                return s, x, evicted
            idle = next((i for i, (_, e) in enumerate(kept) if e.users == 0), None)
            if idle is None:
                return None
            evicted.append(kept.pop(idle)[0])


def _first_gap(used: list[tuple[int, int]], size: int, capacity: int) -> int | None:
    """The lowest offset of `size` free entries among `used` (offset, length) ranges."""
    at = 0
    for base, length in sorted(used):
        if base - at >= size:
            return at
        at = max(at, base + length)
    return at if capacity - at >= size else None
