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
import jax.numpy as jnp

# The largest fused-decode bucket (rows) whose program takes the kernel: where it measured faster than
# XLA's dot (batch 1 and 8 faster, 32 slower; docs/benchmarks.md, session 40).
KERNEL_MAX_TOKENS = 8


@dataclass(frozen=True)
class SkinnyProjection:
    """`x @ stack[layer]` through the skinny kernel for `x` of at most its MAX_ROWS (32) rows, both in
    bf16 and K, N multiples of 64; XLA's dot otherwise. `interpret`: Mosaic GPU's interpreter (CPU tests)."""

    interpret: bool = False

    def __call__(self, x: jax.Array, stack: jax.Array, layer) -> jax.Array:
        from pallas_kernels import skinny_gemm_mgpu as sk

        k, n = stack.shape[1:]
        fits = (x.ndim == 2 and 1 <= x.shape[0] <= sk.MAX_ROWS and x.dtype == jnp.bfloat16
                and stack.dtype == jnp.bfloat16 and k % 64 == 0 and n % 64 == 0)
        if not fits:
            return x @ stack[layer]
        return sk.skinny_matmul(x, stack, layer=layer, interpret=self.interpret)


@dataclass(frozen=True)
class LayerWeight:
    """Layer `layer` of the stacked weight `stack`, multiplied from the left by `projection`."""

    stack: jax.Array
    layer: jax.Array
    projection: SkinnyProjection

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        return self.projection(x, self.stack, self.layer)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stack.shape[1:]

    @property
    def dtype(self):
        return self.stack.dtype
