"""A decoder layer's projections at a few tokens (1 to `gemv_mgpu.MAX_ROWS`) as fused GEMV kernels (issue 26).

At small batch a projection streams its weight once for a few rows of x: bound by HBM, and by the
small kernels around it (the RMSNorm before, the residual add or SwiGLU after).
`pallas_kernels/gemv_mgpu.py` does the norm, the product and the add or SwiGLU in one kernel from the
`[out, in]` weight, reading each weight tile once for all the rows.

A program that wants it (fused decode's one-row bucket: `CausalLM.gemv_projections`; the functions take up
to `gemv_mgpu.MAX_ROWS` tokens)
has the decoder hand the family's `ModelState.gemv_weights` (its projections and the norms before
them) to the layer as `LayerWeight`s, which the kernel reads in place from their stacks. The functions
below are what a family's layer calls for those steps: with LayerWeights and at most that many tokens
they run the kernel, otherwise the same math in XLA (plain arrays, more tokens), so one layer function
serves every program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mrv2_jax.models.layer_weight import LayerWeight, weight_array
from mrv2_jax.models.layers import linear, rms_norm


def _kernel_takes(x, w) -> bool:
    """Whether the GEMV kernel runs this product: x of at most MAX_ROWS rows, the weight a LayerWeight
    whose shapes and dtypes the kernel tiles."""
    from pallas_kernels.gemv_mgpu import BLOCK_K, MAX_ROWS  # the kernels' module only where a program asks

    if not isinstance(w, LayerWeight) or x.shape[0] > MAX_ROWS:
        return False
    n, k = w.stack.shape[-2:]
    return x.dtype == w.stack.dtype == jnp.bfloat16 and k % BLOCK_K == 0 and n % 16 == 0


# SwiGLU's kernel takes 16 weight rows a CTA (8 gate, 8 up: its outputs' 16-byte store), whose sums fill
# a thread's registers past 4 rows of x; more rows take the product alone and the SwiGLU in XLA.
FUSED_SWIGLU_MAX_ROWS = 4


def layer_gemv(x, w: LayerWeight, **kwargs):
    """gemv_mgpu.gemv of `x` by `w`'s layer of its stack with the kernel config for the shape; `kwargs`:
    the kernel's norm_weight, eps, epilogue and residual."""
    from pallas_kernels.gemv_mgpu import GemvConfig, gemv

    # Wide outputs (qkv, gate/up) take 16 weight rows a CTA at one row of x; narrow ones (o, down) 8 with
    # a deeper ring, so that about as many bytes stay in flight on each SM. Each x row adds a register
    # pair per weight row: past one row a plain product takes 8.
    wide = w.stack.shape[-2] >= 4096
    if kwargs.get("epilogue") == "swiglu" or (wide and x.shape[0] == 1):
        config = GemvConfig(block_n=16, num_stages=4)
    else:
        config = GemvConfig(block_n=8, num_stages=4 if wide else 8)
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
        if x.shape[0] <= FUSED_SWIGLU_MAX_ROWS:
            return layer_gemv(x, gate_up, norm_weight=norm.stack, eps=eps, epilogue="swiglu")
        gate_up_out = layer_gemv(x, gate_up, norm_weight=norm.stack, eps=eps)
    else:
        gate_up_out = linear(rms_norm(x, weight_array(norm), eps), weight_array(gate_up))
    gate, up = jnp.split(gate_up_out, 2, axis=-1)
    return jax.nn.silu(gate) * up
