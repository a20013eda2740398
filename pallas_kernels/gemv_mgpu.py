"""GEMV for decode at batch 1 from a weight stored ``[N, K]``, with the layer's RMSNorm before it and a
residual add or SwiGLU after it (Pallas, Mosaic GPU backend).

Contract. ``gemv(x, w)`` takes ``x [1, K]`` bf16 (one token) and ``w [N, K]``
bf16 (the Hugging Face layout: ``y = x @ w.T``), or a stack ``w [L, N, K]`` with ``layer=`` an int32
scalar (may be traced; the stack is read in place). It accumulates in f32 and returns bf16:

* ``norm_weight`` (``[K]``, or ``[L, K]`` with a stacked ``w``): ``x`` is first
  RMS-normalised over K in f32 and scaled by the weight, ``x * rsqrt(mean(x^2) + eps) * norm_weight``;
* ``epilogue=None``: ``y [1, N]``; ``"residual"``: ``y + residual`` for ``residual [1, N]``;
  ``"swiglu"``: ``w`` holds the gate's ``N / 2`` rows and then up's (a checkpoint's fused gate_up)
  and the result is ``silu(gate) * up``, ``[1, N / 2]``.

``gemv_reference`` is the jnp reference of the same signature. Shapes the kernel cannot tile raise
``ValueError``: ``K`` must be a multiple of ``BLOCK_K`` (256) and ``N`` of ``block_n`` (a multiple
of 8, 16 with SwiGLU).

Why. At batch 1 a projection multiplies each weight element once: it is bound by HBM, and what
matters is keeping enough bytes in flight on every SM. A wgmma kernel's tile has 64 weight rows,
so a 1024-wide projection makes 16 CTAs and must split K to fill the GPU, leaving partial sums
for another kernel to add; then nothing can follow the product in the same kernel. Here the
products run on the CUDA cores (one multiply-add per weight element, far below their rate), so a
CTA can own just ``block_n`` = 8-16 output rows and the whole of K: a 1024-wide projection is
64-128 CTAs, each output is complete in one CTA, and the norm before and the residual add or
SwiGLU after join the kernel (fewer launches a layer, none of the small kernels between them): with
SwiGLU a CTA streams ``block_n / 2`` gate rows and the matching up rows, two tiles a step.

Algorithm. Grid ``(N / block_n,)``, one warpgroup (128 threads) per CTA. ``plgpu.emit_pipeline``
streams the CTA's ``[block_n, BLOCK_K]`` weight tiles (each row contiguous in K; ``kbox`` chunks of
K a tile with ``GemvConfig.kbox``) with the matching ``[1, BLOCK_K]`` tiles of x (and of the norm
weight) through shared memory with TMA, ``num_stages`` deep. Each thread owns 2 columns of a tile
(the warpgroup's strided register layout): it multiplies each weight row's two by x's (times the
norm weight), adding into one f32 register pair per weight row, ``block_n`` pairs a thread; with a
norm it also adds x^2. A warpgroup barrier ends each step, so no thread still reads a stage when the
pipeline refills it. After the last tile each pair is summed across the warpgroup; the norm is
linear in x, so ``rsqrt(mean(x^2) + eps)`` scales the sums then. The epilogue adds the CTA's slice
of the residual (fetched with TMA when the CTA starts) or pairs its gate and up rows, and the CTA
stores its outputs with one TMA copy.

On the CPU (tests) the kernel runs in Mosaic GPU's interpreter (``interpret=True``); lowering for
CUDA on any backend runs Mosaic GPU's layout inference and lowering (TMA boxes, register layouts).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["BLOCK_K", "GemvConfig", "gemv", "gemv_reference"]

BLOCK_K = 256  # a warpgroup's 128 threads x 2 columns
EPILOGUES = (None, "residual", "swiglu")


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """``block_n`` weight rows per CTA (outputs: ``block_n``, or ``block_n / 2`` with SwiGLU), the
    pipeline's depth in tiles, and ``kbox`` 256-wide chunks of K a tile (``[block_n, kbox * 256]``,
    one TMA copy of the weight viewed as ``[N, K / 256, 256]``, as a TMA box is at most 256 wide).
    Each thread keeps ``block_n`` f32 register pairs of sums."""

    block_n: int = 8
    num_stages: int = 4
    kbox: int = 1  # 256-wide chunks of K a tile (a step): fewer, larger TMA copies when > 1


def gemv_reference(x, w, *, layer=None, norm_weight=None, eps: float = 1e-6, epilogue=None, residual=None):
    """What ``gemv`` computes, in jnp."""
    if layer is not None:
        w = w[layer]
        norm_weight = None if norm_weight is None else norm_weight[layer]
    v = x.astype(jnp.float32)
    if norm_weight is not None:
        v = v * lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps) * norm_weight.astype(jnp.float32)
        v = v.astype(jnp.bfloat16).astype(jnp.float32)  # the norm's output as the model rounds it
    y = jnp.dot(v, w.astype(jnp.float32).T)
    if epilogue == "residual":
        y = y.astype(jnp.bfloat16).astype(jnp.float32) + residual.astype(jnp.float32)
    elif epilogue == "swiglu":
        gate, up = jnp.split(y.astype(jnp.bfloat16).astype(jnp.float32), 2, axis=-1)
        y = jax.nn.silu(gate) * up
    return y.astype(jnp.bfloat16)


def _check(x, w, norm_weight, epilogue, residual, config: GemvConfig) -> None:
    if x.ndim != 2 or x.shape[0] != 1:
        raise ValueError(f"x must be one row [1, K], got {tuple(x.shape)}")
    if w.ndim not in (2, 3) or w.shape[-1] != x.shape[1]:
        raise ValueError(f"w must be [N, K] or [L, N, K] with x's K = {x.shape[1]}, got {tuple(w.shape)}")
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"x and w must be bfloat16, got x {x.dtype} and w {w.dtype}")
    n, k = w.shape[-2:]
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    min_block = 16 if epilogue == "swiglu" else 8  # the outputs go out in one TMA copy of >= 16 bytes
    if config.block_n < min_block or config.block_n % 8:
        raise ValueError(f"block_n = {config.block_n} must be a multiple of 8 and at least {min_block}")
    if k % BLOCK_K:
        raise ValueError(f"K = {k} is not a multiple of BLOCK_K = {BLOCK_K}")
    if config.kbox < 1 or k % (BLOCK_K * config.kbox):
        raise ValueError(f"K = {k} is not a multiple of kbox = {config.kbox} chunks of {BLOCK_K}")
    if n % config.block_n:
        raise ValueError(f"N = {n} is not divisible by block_n = {config.block_n}")
    if config.num_stages < 1:
        raise ValueError(f"num_stages = {config.num_stages} must be positive")
    if norm_weight is not None and norm_weight.shape != (*w.shape[:-2], k):
        raise ValueError(f"norm_weight must be {(*w.shape[:-2], k)}, got {tuple(norm_weight.shape)}")
    if (epilogue == "residual") != (residual is not None):
        raise ValueError("residual= is needed by, and only by, epilogue='residual'")
    if residual is not None and residual.shape != (x.shape[0], n):
        raise ValueError(f"residual must be [1, N] = {(1, n)}, got {tuple(residual.shape)}")


def _kernel(layer_gmem, x_gmem, w_gmem, *rest, block_n, steps, stages, k, eps, norm, epilogue, kbox):
    rest = list(rest)
    g_gmem = rest.pop(0) if norm else None
    r_gmem = rest.pop(0) if epilogue == "residual" else None
    (out_gmem,) = rest
    j = lax.axis_index("n")
    w_gmem = w_gmem.at[layer_gmem[0]]  # this layer's [N, K] of the stack ([N, K / 256, 256] when kbox > 1)
    layout = plgpu.Layout.WG_STRIDED((BLOCK_K,), vec_size=2)
    zero = plgpu.layout_cast(jnp.zeros((BLOCK_K,), jnp.float32), layout)

    num_w = 2 if epilogue == "swiglu" else 1  # SwiGLU: a gate tile and an up tile a step

    def row(tile, r, c):
        """Row r of a tile's chunk c, [BLOCK_K] in f32."""
        return (tile[r, c, :] if kbox > 1 else tile[r, :]).astype(jnp.float32)

    def step(_, *refs_and_carry):
        *refs, carry = refs_and_carry
        w_smems, (x_smem, *g_smem) = refs[:num_w], refs[num_w:]
        sums, square = carry
        rows = [(w_smem, r) for w_smem in w_smems for r in range(block_n // num_w)]  # gate's rows, then up's
        for c in range(kbox):
            x = row(x_smem, 0, c)
            if norm:
                square = square + x * x
                x = x * row(g_smem[0], 0, c)
            weights = [row(w_smem, r, c) for w_smem, r in rows]
            sums = tuple(s + w * x for s, w in zip(sums, weights))
        # Every thread's reads of this stage are done before the pipeline refills it with TMA (the
        # pipeline syncs nothing after the body: without this a lagging warp could read the refill).
        plgpu.commit_smem()
        return sums, square

    # A tile is [rows, BLOCK_K] of the [N, K] weight, or [rows, kbox, BLOCK_K] of its [N, K / 256, 256] view.
    box, at = ((kbox, BLOCK_K), lambda *ij: (*ij, 0)) if kbox > 1 else ((BLOCK_K,), lambda *ij: ij)
    rows, blocks = block_n // num_w, w_gmem.shape[0] // block_n  # the up rows start `blocks` tiles after the gate's
    w_specs = [plgpu.BlockSpec((rows, *box), lambda i, t=t: at(j + t * blocks, i)) for t in range(num_w)]
    in_specs = [*w_specs, plgpu.BlockSpec((1, *box), lambda i: at(0, i))]
    operands = [w_gmem] * num_w + [x_gmem]
    if norm:
        in_specs.append(plgpu.BlockSpec((1, *box), lambda i: at(0, i)))
        operands.append(g_gmem.at[layer_gmem[0]])
    num_out = block_n // 2 if epilogue == "swiglu" else block_n

    # The residual's slice and its barrier exist only with that epilogue.
    residual_scratch = (dict(r_smem=plgpu.SMEM((1, num_out), out_gmem.dtype), barrier=plgpu.Barrier())
                        if epilogue == "residual" else {})

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((1, num_out), out_gmem.dtype), **residual_scratch)
    def _body(o_smem, r_smem=None, barrier=None):
        if epilogue == "residual":  # fetched while the weights stream, so it is there for the epilogue
            plgpu.copy_gmem_to_smem(r_gmem.at[:, pl.ds(j * num_out, num_out)], r_smem, barrier)
        sums, square = plgpu.emit_pipeline(
            step, grid=(steps,), in_specs=in_specs, max_concurrent_steps=stages,
            init_carry=((zero,) * block_n, zero))(*operands)
        if epilogue == "residual":
            plgpu.barrier_wait(barrier)
        totals = [jnp.sum(s) for s in sums]  # column sums, across the warpgroup
        if norm:
            # The norm is linear in x: its scale applies to the sums. (The model rounds the normalised
            # x to bf16 before the product; here the sums are rounded once instead.)
            scale = lax.rsqrt(jnp.sum(square) / k + eps)
            totals = [t * scale for t in totals]
        outs = [t.astype(jnp.bfloat16).astype(jnp.float32) for t in totals]  # the product's bf16 result
        if epilogue == "residual":
            outs = [o + r_smem[0, r].astype(jnp.float32) for r, o in enumerate(outs)]
        elif epilogue == "swiglu":
            outs = [g / (1 + jnp.exp(-g)) * u for g, u in zip(outs[:num_out], outs[num_out:])]
        for r, o in enumerate(outs):
            o_smem[0, r] = o.astype(out_gmem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[:, pl.ds(j * num_out, num_out)])
        plgpu.wait_smem_to_gmem(0)


def gemv(x, w, *, layer=None, norm_weight=None, eps: float = 1e-6, epilogue=None, residual=None,
         config: GemvConfig | None = None, interpret=False):
    """``x [1, K] @ w.T`` (``w [N, K]``, or ``w[layer]`` of ``[L, N, K]``) in bf16 with f32 accumulation,
    with an RMSNorm of ``x`` before and a residual add or SwiGLU after (module docstring).

    ``interpret``: run Mosaic GPU's interpreter (CPU tests): ``True`` for its default
    ``plgpu.InterpretGPUParams()``, or such an instance.
    """
    if (w.ndim == 3) != (layer is not None):
        raise ValueError(f"a stacked w [L, N, K] needs layer= and a w [N, K] takes none; got w{tuple(w.shape)} "
                         f"and layer={layer!r}")
    config = config or GemvConfig(block_n=16 if epilogue == "swiglu" else 8)
    _check(x, w, norm_weight, epilogue, residual, config)
    if w.ndim == 2:  # free reshapes: one code path for a weight and a stack of them
        w = w[None]
        norm_weight = None if norm_weight is None else norm_weight[None]
    n, k = w.shape[1:]
    steps = k // (BLOCK_K * config.kbox)
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    num_out = n // 2 if epilogue == "swiglu" else n
    kernel = plgpu.kernel(
        functools.partial(_kernel, block_n=config.block_n, steps=steps, stages=min(config.num_stages, steps), k=k,
                          eps=eps, norm=norm_weight is not None, epilogue=epilogue, kbox=config.kbox),
        out_type=jax.ShapeDtypeStruct((1, num_out), jnp.bfloat16),
        grid=(n // config.block_n,),
        grid_names=("n",),
        interpret=interpret or None,
    )
    chunks = (lambda a: a.reshape(*a.shape[:-1], k // BLOCK_K, BLOCK_K)) if config.kbox > 1 else (lambda a: a)
    operands = [jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1), chunks(x), chunks(w)]
    if norm_weight is not None:
        operands.append(chunks(norm_weight.astype(jnp.bfloat16)[:, None, :]))  # [L, 1, K]: tiles of one row
    if residual is not None:
        operands.append(residual.astype(jnp.bfloat16))
    return kernel(*operands)
