"""A read-only view of the first n ids of a list that only grows: a request's output tokens as one
`RequestOutput` saw them, without copying the whole list at every step."""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from itertools import islice


class TokenIdsView(Sequence):
    """The first `length` ids of `ids` (a list the output processor only ever extends): `len`,
    indexing, slicing (a list), iteration, `==` with a list, `+` with a list. Pickling or copying
    gives a plain list."""

    __slots__ = ("_ids", "_length")

    def __init__(self, ids: list[int], length: int | None = None):
        self._ids, self._length = ids, len(ids) if length is None else length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._ids[: self._length][index]
        i = operator.index(index)
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError("token index out of range")
        return self._ids[i]

    def __iter__(self) -> Iterator[int]:
        return islice(self._ids, self._length)

    def __eq__(self, other) -> bool:
        if not isinstance(other, (list, TokenIdsView)):  # as a list, unequal to a tuple
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # like a list

    def __add__(self, other) -> list[int]:
        return list(self) + list(other)

    def __radd__(self, other) -> list[int]:
        return list(other) + list(self)

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self):
        return list, (list(self),)
