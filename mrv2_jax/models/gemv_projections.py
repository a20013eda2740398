"""A decoder layer's projections at one token (or a few) as fused GEMV kernels (issue 26).

At batch 1 a projection streams its weight once for one row of x: bound by HBM, and by the small
kernels around it (the RMSNorm before, the residual add or SwiGLU after).
`pallas_kernels/gemv_triton.py` does the norm, the product and the add or SwiGLU in one kernel from the
`[out, in]` weight.

A program that wants it (fused decode's one-row bucket, the one-token step bucket:
`CausalLM.gemv_projections`) has the decoder hand the family's `ModelState.gemv_weights` (its
projections and the norms before them) to the layer as `LayerWeight`s, which the kernel reads in
place from their stacks. The functions below are what a family's layer calls for those steps: with
LayerWeights and at most the kernel's `MAX_ROWS` tokens they run the kernel, otherwise the same math
in XLA (plain arrays, more tokens), so one layer function serves every program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mrv2_jax.models.layer_weight import LayerWeight, weight_array
from mrv2_jax.models.layers import linear, rms_norm


def _kernel_takes(x, w) -> bool:
    """Whether the GEMV kernel runs this product: x of a few rows, the weight a LayerWeight whose shapes and
    dtypes the kernel tiles."""
    from pallas_kernels.gemv_triton import MAX_ELEMENTS, MAX_ROWS  # the kernels' module only where asked

    if not isinstance(w, LayerWeight) or x.shape[0] > MAX_ROWS:
        return False
    n, k = w.stack.shape[-2:]
    config = gemv_config(n, k)
    return (x.dtype == w.stack.dtype == jnp.bfloat16 and k % config.block_k == 0 and n % (2 * config.block_n) == 0
            and w.stack.size < MAX_ELEMENTS)


def gemv_config(n: int, k: int):
    """The Triton kernel's tile config for a projection of `n` outputs over `k` inputs (tuned at one row of
    x): four outputs a program, K in 512-wide chunks where it divides; narrow projections (o, down) one
    output a program over 1024-wide chunks, so that their few outputs still make many programs."""
    from pallas_kernels.gemv_triton import GemvConfig

    if n <= 2048 and k % 1024 == 0:
        return GemvConfig(block_n=1, block_k=1024, num_warps=8)
    return GemvConfig(block_n=4, block_k=512 if k % 512 == 0 else 256, num_warps=8)


def layer_gemv(x, w: LayerWeight, **kwargs):
    """gemv_triton.gemv of `x` by `w`'s layer of its stack with the kernel config for the shape; `kwargs`:
    the kernel's norm_weight, eps, epilogue and residual."""
    from pallas_kernels.gemv_triton import gemv

    config = gemv_config(*w.stack.shape[-2:])
    return gemv(x, w.stack, layer=w.layer, config=config, interpret=jax.default_backend() != "gpu", **kwargs)


def project(x, w):
    """`linear(x, w)`."""
    if _kernel_takes(x, w):
        return layer_gemv(x, w)
    return linear(x, weight_array(w))


def norm_linear(x, norm, w, eps: float):
    """`linear(rms_norm(x, norm), w)`."""
    if _kernel_takes(x, w) and isinstance(norm, LayerWeight):
        return layer_gemv(x, w, norm_weight=norm.stack, eps=eps)
    return linear(rms_norm(x, weight_array(norm), eps), weight_array(w))


def linear_add(x, w, residual):
    """`residual + linear(x, w)`."""
    if _kernel_takes(x, w):
        return layer_gemv(x, w, epilogue="residual", residual=residual)
    return residual + linear(x, weight_array(w))


def norm_swiglu(x, norm, gate_up, eps: float):
    """`silu(gate) * up` of `linear(rms_norm(x, norm), gate_up)`, `gate_up` [2I, H]: gate's rows, then up's."""
    if _kernel_takes(x, gate_up) and isinstance(norm, LayerWeight):
        return layer_gemv(x, gate_up, norm_weight=norm.stack, eps=eps, epilogue="swiglu")
    gate, up = jnp.split(linear(rms_norm(x, weight_array(norm), eps), weight_array(gate_up)), 2, axis=-1)
    return jax.nn.silu(gate) * up
