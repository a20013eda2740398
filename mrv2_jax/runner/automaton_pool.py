"""Host bookkeeping of the device's automaton pool (sample/automata.py): which automata are
loaded at which state and exception offsets, and which requests use them.

Requests with the same constraint share one copy (the compile cache hands out one automaton
object per constraint). An automaton no request uses stays loaded, and is dropped (least
recently used first) only when a new one needs its room.
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

    def acquire(self, req_id: str, automaton) -> tuple[int, int, bool]:
        """-> (state base, exception base, whether it must be copied in now)."""
        key = id(automaton)
        entry = self._loaded.get(key)
        fresh = entry is None
        if fresh:
            entry = self._place(automaton)
            self._loaded[key] = entry
        self._loaded.move_to_end(key)
        entry.users += 1
        self._user_of[req_id] = key
        return entry.state_base, entry.exception_base, fresh

    def release(self, req_id: str) -> None:
        key = self._user_of.pop(req_id, None)
        if key is not None:
            self._loaded[key].users -= 1

    def _place(self, automaton) -> _Loaded:
        while True:
            s = _first_gap([(e.state_base, e.automaton.num_states) for e in self._loaded.values()],
                           automaton.num_states, self.num_states)
            x = _first_gap([(e.exception_base, e.automaton.num_exceptions) for e in self._loaded.values()],
                           automaton.num_exceptions, self.num_exceptions)
            if s is not None and x is not None:
                return _Loaded(automaton, s, x)
            idle = next((k for k, e in self._loaded.items() if e.users == 0), None)
            if idle is None:
                raise RuntimeError(
                    "the device's automaton pool is full with the constraints of running requests; "
                    "raise MRV2_STRUCTURED_STATES / MRV2_STRUCTURED_EXCEPTIONS")
            del self._loaded[idle]


def _first_gap(used: list[tuple[int, int]], size: int, capacity: int) -> int | None:
    """The lowest offset of `size` free entries among `used` (offset, length) ranges."""
    at = 0
    for base, length in sorted(used):
        if base - at >= size:
            return at
        at = max(at, base + length)
    return at if capacity - at >= size else None
