"""Projection weights read in place by the small-batch kernels.

A decode step with a few rows spends most of its device time streaming the projection weights
(issue 26). Two kernels stream one layer of a stacked `[L, K, N]` weight in place, which a slice
handed to a custom call would not (XLA copies the slice first): `decode_gemv`
(pallas_kernels/decode_gemv.py, `GemvProjection`), which also takes the RMSNorm before a
projection, SwiGLU's product after it or the residual add, and `skinny_matmul`
(pallas_kernels/skinny_gemm_mgpu.py, `SkinnyProjection`), the product alone.

Where a program uses a kernel, the decoder hands the layer the weights its family names in
`ModelState.projection_weights` as `LayerWeight`s, which know their stack and layer. The layer
multiplies through `project(x, w, norm=, activation=, residual=)`, which runs the kernel for a
`LayerWeight` and XLA's ops one after the other for a plain array; `x @ w` works too (the product
alone). A family lists a norm weight there only if it reaches it through `project` alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from mrv2_jax.models.layers import rms_norm

# The largest fused-decode bucket (rows) whose program takes the skinny GEMM: the sizes where it
# measured faster than XLA's dot (docs/benchmarks.md, "Decode projections through the skinny GEMM").
KERNEL_MAX_TOKENS = 8
# The same for decode_gemv: one row (docs/benchmarks.md, "Decode projections as weight-streaming
# GEMVs": at 8 rows it measured far slower than XLA's dot).
GEMV_MAX_TOKENS = 1


@dataclass(frozen=True)
class SkinnyProjection:
    """`x @ stack[layer]` through the skinny kernel where it takes the shapes and dtypes (at most 32
    rows, bf16, tile-divisible K and N: `skinny_gemm_mgpu.accepts`), XLA's dot otherwise.
    `interpret`: Mosaic GPU's interpreter (CPU tests)."""

    interpret: bool = False
    fuses = False  # the product alone: `LayerWeight.project` runs the norm and epilogue as XLA ops

    def __call__(self, x: jax.Array, stack: jax.Array, layer) -> jax.Array:
        from pallas_kernels import skinny_gemm_mgpu as sk

        if stack.ndim != 3 or not sk.accepts(x, jax.ShapeDtypeStruct(stack.shape[1:], stack.dtype)):
            return x @ stack[layer]
        return sk.skinny_matmul(x, stack, layer=layer, interpret=self.interpret)


@dataclass(frozen=True)
class GemvProjection:
    """`[residual +] act(rms_norm(x) @ stack[layer])` through `decode_gemv` where it takes the
    operands (at most 32 rows, one dtype), XLA's ops otherwise. `interpret`: Pallas's interpreter."""

    interpret: bool = False
    fuses = True

    def takes(self, x: jax.Array, stack: jax.Array) -> bool:
        from pallas_kernels import decode_gemv

        return decode_gemv.accepts(x, stack)

    def __call__(self, x: jax.Array, stack: jax.Array, layer, **fused) -> jax.Array:
        from pallas_kernels import decode_gemv

        return decode_gemv.decode_gemv(x, stack, layer, interpret=self.interpret, **fused)


@dataclass(frozen=True)
class LayerWeight:
    """Layer `layer` of the stacked weight `stack`, multiplied from the left by `projection`."""

    stack: jax.Array
    layer: jax.Array
    projection: SkinnyProjection | GemvProjection

    @property
    def array(self) -> jax.Array:
        """The layer's slice, for XLA's own ops."""
        return self.stack[self.layer]

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        if self.projection.fuses:
            return self.project(x)
        return self.projection(x, self.stack, self.layer)

    def project(self, x, norm=None, activation=None, residual=None) -> jax.Array:
        """`project(x, self, ...)` (below): one kernel where the projection fuses and takes `x`, and
        the norm weight (if any) is a LayerWeight too; else the kernel's product with XLA's ops around."""
        norm_weight = norm[0] if norm is not None else None
        if (self.projection.fuses and self.projection.takes(x, self.stack)
                and (norm is None or isinstance(norm_weight, LayerWeight))):
            stacked_norm = None if norm is None else (norm_weight.stack, norm[1])
            return self.projection(x, self.stack, self.layer, norm=stacked_norm, activation=activation,
                                   residual=residual)
        if norm is not None:
            x = rms_norm(x, weight_array(norm_weight), norm[1])
        y = x @ self.array if self.projection.fuses else self.projection(x, self.stack, self.layer)
        return _epilogue(y, activation, residual)


def weight_array(w) -> jax.Array:
    """A plain array of a weight that may be a LayerWeight."""
    return w.array if isinstance(w, LayerWeight) else w


def _epilogue(y, activation, residual):
    if activation == "silu_mul":
        gate, up = jnp.split(y, 2, axis=-1)
        y = jax.nn.silu(gate) * up
    elif activation is not None:
        raise ValueError(f"unknown activation {activation!r}")
    return y if residual is None else residual + y


def project(x: jax.Array, w, *, norm=None, activation=None, residual=None) -> jax.Array:
    """`[residual +] act(rms_norm(x, *norm) @ w)`: `norm` = (weight, eps) or None, `activation`
    None or "silu_mul" (`silu(gate) * up` of the fused `[gate | up]` product). For a LayerWeight `w`
    the small-batch kernel may do it all in one launch; for a plain array, XLA's ops in turn."""
    if isinstance(w, LayerWeight):
        return w.project(x, norm, activation, residual)
    if norm is not None:
        x = rms_norm(x, weight_array(norm[0]), norm[1])
    return _epilogue(x @ w, activation, residual)
