"""A layer's weight handed on with its stack, for kernels that read the stacked weight in place.

A custom call given one layer's slice of a stacked `[L, ...]` weight makes XLA copy that slice
first; given the whole stack and the layer index, the kernel reads the layer where it lies. The
decoder hands a family's `ModelState.in_place_weights` to its layer math as `LayerWeight`s (the
q/k norms of the fused q/k kernel: models/attention.py); XLA's own ops take `weight_array(w)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class LayerWeight:
    """Layer `layer` of the stacked weight `stack`."""

    stack: jax.Array
    layer: jax.Array

    @property
    def array(self) -> jax.Array:
        """The layer's slice, for XLA's own ops."""
        return self.stack[self.layer]


def weight_array(w):
    """A weight that may be a LayerWeight as a plain array (None stays None)."""
    return w.array if isinstance(w, LayerWeight) else w
