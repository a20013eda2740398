"""Projection weights read in place by the small-batch GEMM kernel.

A decode step with a few rows spends most of its device time streaming the projection weights
(issue 26). `skinny_matmul` (pallas_kernels/skinny_gemm_mgpu.py) streams a weight at up to 32 rows;
it reads one layer of the stacked `[L, K, N]` weight in place, which a slice handed to a custom
call would not (XLA copies the slice first).

The families' layer code stays as it is: it multiplies `x @ p[name]`. Where a program uses the
kernel, the decoder hands the layer those weights as `LayerWeight`s, which know their stack and
layer and answer `x @ w` through the kernel when `x` has few enough rows (`SkinnyProjection`),
else through XLA's dot of the layer's slice. A family names the weights it only ever multiplies
this way in `ModelState.projection_weights`; every other parameter stays a plain array.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

# The largest fused-decode bucket (rows) whose program takes the kernel: the sizes where it measured
# faster than XLA's dot (docs/benchmarks.md, "Decode projections through the skinny GEMM").
KERNEL_MAX_TOKENS = 8


@dataclass(frozen=True)
class SkinnyProjection:
    """`x @ stack[layer]` through the skinny kernel where it takes the shapes and dtypes (at most 32
    rows, bf16, tile-divisible K and N: `skinny_gemm_mgpu.accepts`), XLA's dot otherwise.
    `interpret`: Mosaic GPU's interpreter (CPU tests)."""

    interpret: bool = False

    def __call__(self, x: jax.Array, stack: jax.Array, layer) -> jax.Array:
        from pallas_kernels import skinny_gemm_mgpu as sk

        if stack.ndim != 3 or not sk.accepts(x, jax.ShapeDtypeStruct(stack.shape[1:], stack.dtype)):
            return x @ stack[layer]
        return sk.skinny_matmul(x, stack, layer=layer, interpret=self.interpret)


@dataclass(frozen=True)
class LayerWeight:
    """Layer `layer` of the stacked weight `stack`, multiplied from the left by `projection` (None:
    XLA's dot of the slice). Also the form of `ModelState.in_place_weights`, which a kernel reads in
    place (the q/k norms: models/attention.py)."""

    stack: jax.Array
    layer: jax.Array
    projection: SkinnyProjection | None = None

    @property
    def array(self) -> jax.Array:
        """The layer's slice, for XLA's own ops."""
        return self.stack[self.layer]

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        if self.projection is None:
            return x @ self.array
        return self.projection(x, self.stack, self.layer)


def weight_array(w):
    """A weight that may be a LayerWeight as a plain array (None stays None)."""
    return w.array if isinstance(w, LayerWeight) else w
