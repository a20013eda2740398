"""One host buffer per step: many small int32 arrays travel in one transfer.

Every separate numpy argument to a jitted call costs a host->device copy of its own
(docs/benchmarks.md says how much), so the per-step inputs are laid out back to back in a single
int32 buffer with static offsets, and sliced apart again inside the jit (slices of a static
layout are free).
"""

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np


@dataclass
class PackedLayout:
    """Named fields of fixed shapes, packed back to back in one int32 buffer. Fields named
    in `float_fields` hold float32 values stored bit for bit (bitcast, not converted)."""

    shapes: dict[str, tuple[int, ...]]
    float_fields: frozenset[str] = frozenset()
    offsets: dict[str, int] = field(init=False)
    size: int = field(init=False)

    def __post_init__(self):
        self.offsets, self._spans, pos = {}, {}, 0
        for name, shape in self.shapes.items():
            n = int(np.prod(shape))
            self.offsets[name] = pos
            self._spans[name] = (pos, pos + n, shape)
            pos += n
        self.size = pos

    def empty(self) -> np.ndarray:
        return np.zeros(self.size, np.int32)

    def view(self, buf: np.ndarray, name: str) -> np.ndarray:
        """A writable numpy view of one field inside a host buffer."""
        lo, hi, shape = self._spans[name]  # precomputed: this runs every step on the hot path
        view = buf[lo:hi].reshape(shape)
        return view.view(np.float32) if name in self.float_fields else view

    def unpack(self, buf: jax.Array) -> dict[str, jax.Array]:
        """Inside a jit: the device buffer split back into named arrays."""
        out = {}
        for name, shape in self.shapes.items():
            lo = self.offsets[name]
            part = buf[lo : lo + int(np.prod(shape))].reshape(shape)
            out[name] = jax.lax.bitcast_convert_type(part, jnp.float32) if name in self.float_fields else part
        return out
