"""A request's sample logprobs as a list of `{token_id: Logprob}` dicts that are built when read.

Building the dicts as tokens arrive (21 `Logprob`s and their texts per token, for each of 256
requests) made the engine host-bound, and a streaming request's per-step `list(...)` copy was
O(length) per step. Instead the output processor appends the runner's per-token entries (a
`runner.token_logprobs.LogprobRow`, a reference into its step's host arrays) to a
`LogprobStore`, in O(1), and each output gets a `LazyLogprobs` view of the store's first `len`
entries: O(1) to make, and unchanged by tokens appended later. A token's dict is built on its
first read and kept, so every view of the store shares it, as the outputs' lists used to.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence

from mrv2_jax.engine.output import Logprob
from mrv2_jax.runner.token_logprobs import LogprobRow

# A row keeps its whole step's arrays alive. A request's rows older than this many tokens are
# detached (copied into lists, a small cost each) so that one long request does not pin the arrays of
# every step it lived through; shorter requests never pay for it.
ROWS_KEPT = 1024


def logprob_dict(entry, decode: Callable[[int], str | None]) -> dict[int, Logprob]:
    """A TokenLogprobs or LogprobRow -> {token_id: Logprob}, the sampled token first (if it is
    also in the top n, its entry is kept: same logprob, rank counted as 1 + strictly larger)."""
    out: dict[int, Logprob] = {}
    for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
        if token_id not in out:
            out[token_id] = Logprob(logprob, rank, decode(token_id))
    return out


class LogprobStore:
    """One request's sample logprobs, append-only (the output processor appends, on the engine
    thread; views may be read on another thread: no write moves or changes what an index means)."""

    __slots__ = ("_entries", "_dicts", "_decode", "_rows_kept")

    def __init__(self, decode: Callable[[int], str | None], rows_kept: int = ROWS_KEPT):
        self._entries: list = []  # per token: a LogprobRow, or a TokenLogprobs once detached
        self._dicts: dict[int, dict[int, Logprob]] = {}  # token index -> its dict, once read
        self._decode = decode
        self._rows_kept = rows_kept

    def __len__(self) -> int:
        return len(self._entries)

    def extend(self, entries) -> None:
        for entry in entries:
            self._entries.append(entry)
            old = len(self._entries) - 1 - self._rows_kept
            if old >= 0 and isinstance(self._entries[old], LogprobRow):
                self._entries[old] = self._entries[old].detach()

    def dict_at(self, index: int) -> dict[int, Logprob]:
        built = self._dicts.get(index)
        if built is None:
            built = self._dicts[index] = logprob_dict(self._entries[index], self._decode)
        return built

    def snapshot(self) -> LazyLogprobs:
        return LazyLogprobs(self, 0, len(self._entries))


class LazyLogprobs(Sequence):
    """A read-only list of `{token_id: Logprob}` dicts, one per generated token (see
    `CompletionOutput.logprobs`): `len`, indexing, slicing (a view, like this one), iteration,
    `==` with a list of dicts. Pickling or copying gives a plain list."""

    __slots__ = ("_store", "_start", "_stop")

    def __init__(self, store: LogprobStore, start: int, stop: int):
        self._store, self._start, self._stop = store, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return LazyLogprobs(self._store, self._start + start, self._start + max(start, stop))
        i = operator.index(index)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("logprobs index out of range")
        return self._store.dict_at(self._start + i)

    def __iter__(self) -> Iterator[dict[int, Logprob]]:
        for i in range(self._start, self._stop):
            yield self._store.dict_at(i)

    def __eq__(self, other) -> bool:
        if not isinstance(other, (list, LazyLogprobs)):  # as a list, unequal to a tuple
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # like a list

    def __repr__(self) -> str:
        return f"LazyLogprobs({list(self)!r})"

    def __reduce__(self):
        return list, (list(self),)
