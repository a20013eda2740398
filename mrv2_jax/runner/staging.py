"""The step's packed input, in device buffers that stay where they are from call to call.

XLA records a step program's CUDA graph again whenever an allocation the graph uses sits at
another address than in the call before. A packed input put on the device fresh for every call
moved every call, and with it every command that reads it (each layer's attention and KV write):
recording them again cost more host time than the rest of the call (docs/benchmarks.md, issue 25).
So each buffer size keeps one device buffer here; a small program copies the step's host buffer
into it (donating it: the copy lands at the same address), and the step program takes that buffer
donated and hands it back unchanged, so the recorded graph never sees it move.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np


def _refill(buffer, packed):
    return packed


class PackedStaging:
    """One device buffer per capacity (the packed inputs' sizes). `take(packed)` fills the buffer
    of that size with `packed` and hands it out; the step returns it and `give_back` keeps it for
    the next call. `place(host_array)` puts a host array where the step wants its input (default:
    the default device; tensor parallelism: replicated over its mesh)."""

    def __init__(self, capacities, place: Callable[[np.ndarray], jax.Array] = jax.device_put):
        self._place = place
        self._buffers: dict[int, jax.Array] = {}
        self._refill = {}
        for capacity in sorted(set(capacities)):
            buffer = self._new(capacity)
            # keep_unused: the old contents are never read, but the argument must stay to be reused.
            self._refill[capacity] = jax.jit(_refill, donate_argnums=(0,), keep_unused=True).lower(
                buffer, buffer).compile()
            self._buffers[capacity] = buffer

    def _new(self, capacity: int) -> jax.Array:
        return self._place(np.zeros(capacity, np.int32))

    def take(self, packed) -> jax.Array:
        """The buffer of `packed`'s size, holding `packed` (a host or device int32 array)."""
        capacity = packed.shape[0]
        if capacity not in self._refill:
            raise ValueError(f"no staging buffer holds a packed input of {capacity} values "
                             f"(sizes: {sorted(self._refill)})")
        # A buffer lost to a failed call (donated, never given back) is made again.
        buffer = self._buffers.pop(capacity, None)
        if buffer is None:
            buffer = self._new(capacity)
        return self._refill[capacity](buffer, packed)

    def give_back(self, buffer: jax.Array) -> None:
        """Keep the buffer a step returned (the one `take` handed out) for the next call."""
        self._buffers[buffer.shape[0]] = buffer

    def buffers(self) -> list[jax.Array]:
        """The buffers held now, by size (benchmarks and tests watch their addresses)."""
        return [self._buffers[c] for c in sorted(self._buffers)]
