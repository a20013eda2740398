"""A decoder layer's projections at one token or a few tens as fused Triton kernels (issue 26).

In decode a projection streams its weight once for a few rows of x: bound by HBM, and by the small
kernels around it (the RMSNorm before, the residual add or SwiGLU after). One kernel does the norm,
the product and the add or SwiGLU from the `[out, in]` weight: `pallas_kernels/gemv_triton.py` for one
row (CUDA cores), `pallas_kernels/decode_gemm_triton.py` for 2-64 rows (tensor cores).

A program that wants them (fused decode's one-row bucket with `decode_projections=gemv`, its buckets of
up to 64 rows with `triton`: `CausalLM.gemv_projections`) has the decoder hand the family's
`ModelState.gemv_weights` (its projections and the norms before them) to the layer as `LayerWeight`s,
which the kernels read in place from their stacks. The functions below are what a family's layer
calls for those steps: with LayerWeights and at most 64 tokens they run a kernel, otherwise the same
math in XLA (plain arrays, more tokens), so one layer function serves every program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mrv2_jax.models.layer_weight import LayerWeight, weight_array
from mrv2_jax.models.layers import linear, rms_norm


def _kernel_takes(x, w) -> bool:
    """Whether a projection kernel runs this product: x of at most `decode_gemm_triton.MAX_ROWS` rows, the
    weight a LayerWeight whose shapes and dtypes the row count's kernel tiles."""
    from pallas_kernels import decode_gemm_triton, gemv_triton  # the kernels' modules only where asked

    if not isinstance(w, LayerWeight) or x.shape[0] > decode_gemm_triton.MAX_ROWS:
        return False
    n, k = w.stack.shape[-2:]
    config = kernel_config(n, k, x.shape[0])
    return (x.dtype == w.stack.dtype == jnp.bfloat16 and k % config.block_k == 0 and n % (2 * config.block_n) == 0
            and w.stack.size < gemv_triton.MAX_ELEMENTS)


def kernel_config(n: int, k: int, rows: int = 1):
    """The tile config for `rows` rows of x by a projection of `n` outputs over `k` inputs.

    One row, the CUDA-core GEMV (gemv_triton): four outputs a program, K in 512-wide chunks where it
    divides; narrow projections (o, down) one output a program over 1024-wide chunks, so that their few
    outputs still make many programs. More rows, the tensor-core kernel (decode_gemm_triton): 16 outputs a
    program over 256-wide chunks, five chunks in flight, three for the wide projections (qkv, gate_up:
    more programs to keep the SMs busy)."""
    from pallas_kernels.decode_gemm_triton import DecodeGemmConfig
    from pallas_kernels.gemv_triton import GemvConfig

    if rows > 1:
        return DecodeGemmConfig(block_n=16, block_k=256 if k % 256 == 0 else 128, num_warps=4,
                                num_stages=3 if n >= 4096 else 5)
    if n <= 2048 and k % 1024 == 0:
        return GemvConfig(block_n=1, block_k=1024, num_warps=8)
    return GemvConfig(block_n=4, block_k=512 if k % 512 == 0 else 256, num_warps=8)


def layer_kernel(x, w: LayerWeight, **kwargs):
    """`x` by `w`'s layer of its stack, read in place: one row on gemv_triton.gemv, more on
    decode_gemm_triton.decode_gemm, with the config for the shape; `kwargs`: the kernels' norm_weight,
    eps, epilogue and residual."""
    from pallas_kernels.decode_gemm_triton import decode_gemm
    from pallas_kernels.gemv_triton import gemv

    config = kernel_config(*w.stack.shape[-2:], x.shape[0])
    kernel = gemv if x.shape[0] == 1 else decode_gemm
    return kernel(x, w.stack, layer=w.layer, config=config, interpret=jax.default_backend() != "gpu", **kwargs)


def project(x, w):
    """`linear(x, w)`."""
    if _kernel_takes(x, w):
        return layer_kernel(x, w)
    return linear(x, weight_array(w))


def norm_linear(x, norm, w, eps: float):
    """`linear(rms_norm(x, norm), w)`."""
    if _kernel_takes(x, w) and isinstance(norm, LayerWeight):
        return layer_kernel(x, w, norm_weight=norm.stack, eps=eps)
    return linear(rms_norm(x, weight_array(norm), eps), weight_array(w))


def linear_add(x, w, residual):
    """`residual + linear(x, w)`."""
    if _kernel_takes(x, w):
        return layer_kernel(x, w, epilogue="residual", residual=residual)
    return residual + linear(x, weight_array(w))


def norm_swiglu(x, norm, gate_up, eps: float):
    """`silu(gate) * up` of `linear(rms_norm(x, norm), gate_up)`, `gate_up` [2I, H]: gate's rows, then up's."""
    if _kernel_takes(x, gate_up) and isinstance(norm, LayerWeight):
        return layer_kernel(x, gate_up, norm_weight=norm.stack, eps=eps, epilogue="swiglu")
    gate, up = jnp.split(linear(rms_norm(x, weight_array(norm), eps), weight_array(gate_up)), 2, axis=-1)
    return jax.nn.silu(gate) * up
