"""FP8 block-scaled weights (`quantization_config.quant_method == "fp8"`, as in the
DeepSeek-V3 / Qwen3-FP8 / GLM-4.5-FP8 checkpoints).

A quantised linear weight `W` ([out, in] in the checkpoint) is stored as float8_e4m3fn with a
float32 `weight_scale_inv` of shape [cdiv(out, 128), cdiv(in, 128)]: the real weight is
`W_fp8 * scale` per 128x128 block. We keep both as they are (in our layout: `<name>` float8
[..., out, in] and `<name>_scale` float32 [..., out/128, in/128], the routed experts' transposed to
[..., in, out] and [..., in/128, out/128]), so the model holds one byte per weight and no bf16 copy.

Matmuls: routed experts dequantise inside the grouped GEMM kernel (tile by tile, in
registers); other linears go through `linear()`, which multiplies by the dequantised weight
and leaves it to XLA to fuse the convert and scaling into the dot's operand (measure it; the
activations stay in the model dtype: weight-only dequantisation, more accurate than the
checkpoints' dynamic FP8 activations).
"""

from dataclasses import replace

import jax.numpy as jnp

from mrv2_jax.models import layers

FP8_DTYPE = jnp.float8_e4m3fn
SCALE_SUFFIX = "_scale"


def fp8_block_size(hf_config) -> int | None:
    """The checkpoint's square FP8 block size, or None for an unquantised checkpoint."""
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    method = q.get("quant_method")
    if method != "fp8":
        raise NotImplementedError(f"quantization method {method!r} is not supported (only 'fp8')")
    block = q.get("weight_block_size")
    if not block or len(block) != 2 or block[0] != block[1]:
        raise NotImplementedError(f"FP8 needs a square weight_block_size, got {block!r}")
    return int(block[0])


def quantize_layout(shapes: dict, sources: dict, dtypes: dict, block: int, exempt=()):
    """Turn every linear weight (except `exempt`) of a parameter layout into an FP8 weight
    plus its block scales. Returns new (shapes, sources, dtypes)."""
    shapes, sources, dtypes = dict(shapes), dict(sources), dict(dtypes)
    for name, source in list(sources.items()):
        if not source.linear or name in exempt:
            continue
        *lead, rows, cols = shapes[name]
        if source.widths and any(w % block for w in source.widths):
            # Fused pieces whose widths are not whole blocks (GLM-4.5-Air's dense MLP, 10944
            # wide) would put scale blocks across the seam: keep this one in the model dtype
            # (the loader dequantises it).
            continue
        dtypes[name] = FP8_DTYPE
        scale = name + SCALE_SUFFIX
        shapes[scale] = (*lead, -(-rows // block), -(-cols // block))
        dtypes[scale] = jnp.float32
        sources[scale] = replace(
            source, hf_names=tuple(n.replace(".weight", ".weight_scale_inv") for n in source.hf_names),
            widths=tuple(w // block for w in source.widths))
    return shapes, sources, dtypes


def dequantize(w, scale, dtype, block: int = 128):
    """FP8 [..., R, C] with block scales [..., cdiv(R, b), cdiv(C, b)] -> `dtype`."""
    from pallas_kernels.grouped_gemm import dequantize_blocks

    return dequantize_blocks(w, scale, block, dtype)


def linear(x, params: dict, name: str, block: int = 128):
    """`linear(x, params[name])` (a weight [out, in]), dequantising an FP8 weight on the fly when it has
    block scales."""
    w = params[name]
    scale = params.get(name + SCALE_SUFFIX)
    if scale is not None:
        w = dequantize(w, scale, x.dtype, block)
    return layers.linear(x, w)
