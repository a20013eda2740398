"""A decoder layer's projections at one token (or a few) as fused GEMV kernels (issue 26).

At batch 1 a projection streams its weight once for one row of x: bound by HBM, and by the small
kernels around it (the RMSNorm before, the residual add or SwiGLU after).
`pallas_kernels/gemv_triton.py` does the norm, the product and the add or SwiGLU in one kernel from the
`[out, in]` weight; `pallas_kernels/gemv_pdl_mgpu.py` (one row, Mosaic GPU) does the same and loads its
weights while the kernel before it still runs. A LayerWeight names the kernel that is to read it.

A program that wants it (fused decode's one-row bucket: `CausalLM.gemv_projections`) has the decoder
hand the family's `ModelState.gemv_weights` (its projections and the norms before them) to the layer
as `LayerWeight`s, which the kernel reads in place from their stacks. The functions below are what a
family's layer calls for those steps: with LayerWeights and at most the kernel's `MAX_ROWS` tokens
they run the kernel, otherwise the same math in XLA (plain arrays, more tokens), so one layer function
serves every program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mrv2_jax.models.layer_weight import LayerWeight, weight_array
from mrv2_jax.models.layers import linear, rms_norm


def _kernel_takes(x, w) -> bool:
    """Whether a GEMV kernel runs this product: the weight a LayerWeight for one (`w.kernel`), x of the rows
    it takes, the shapes and dtypes it tiles."""
    from pallas_kernels import gemv_triton  # the kernels' modules only where asked

    if not isinstance(w, LayerWeight) or w.kernel is None or x.dtype != w.stack.dtype or x.dtype != jnp.bfloat16:
        return False
    n, k = w.stack.shape[-2:]
    if w.kernel == "mgpu_pdl":
        from pallas_kernels import gemv_pdl_mgpu

        block_n = gemv_pdl_mgpu.GemvPdlConfig().block_n
        return (x.shape[0] == 1 and k % gemv_pdl_mgpu.CHUNK == 0 and n % (2 * block_n) == 0
                and 2 * block_n * k * 2 <= gemv_pdl_mgpu.SMEM_BYTES and w.stack.size < gemv_triton.MAX_ELEMENTS)
    config = gemv_config(n, k)
    return (x.shape[0] <= gemv_triton.MAX_ROWS and k % config.block_k == 0 and n % (2 * config.block_n) == 0
            and w.stack.size < gemv_triton.MAX_ELEMENTS)


def gemv_config(n: int, k: int):
    """The Triton kernel's tile config for a projection of `n` outputs over `k` inputs (tuned at one row of
    x): four outputs a program, K in 512-wide chunks where it divides; narrow projections (o, down) one
    output a program over 1024-wide chunks, so that their few outputs still make many programs."""
    from pallas_kernels.gemv_triton import GemvConfig

    if n <= 2048 and k % 1024 == 0:
        return GemvConfig(block_n=1, block_k=1024, num_warps=8)
    return GemvConfig(block_n=4, block_k=512 if k % 512 == 0 else 256, num_warps=8)


def layer_gemv(x, w: LayerWeight, **kwargs):
    """`w.kernel`'s GEMV of `x` by `w`'s layer of its stack: gemv_triton.gemv with the config for the shape,
    or gemv_pdl_mgpu.gemv; `kwargs`: the kernels' norm_weight, eps, epilogue and residual."""
    interpret = jax.default_backend() != "gpu"
    if w.kernel == "mgpu_pdl":
        from pallas_kernels.gemv_pdl_mgpu import gemv as gemv_pdl

        return gemv_pdl(x, w.stack, layer=w.layer, interpret=interpret, **kwargs)
    from pallas_kernels.gemv_triton import gemv

    return gemv(x, w.stack, layer=w.layer, config=gemv_config(*w.stack.shape[-2:]), interpret=interpret, **kwargs)


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
