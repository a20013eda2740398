"""GEMV for decode at small batch from a weight stored ``[N, K]``, with the layer's RMSNorm before it and
a residual add or SwiGLU after it (Pallas, Triton backend).

Contract. ``gemv(x, w)`` takes ``x [R, K]`` bf16 (R tokens, 1 <= R <= ``MAX_ROWS``) and ``w [N, K]``
bf16 (the Hugging Face layout: ``y = x @ w.T``), or a stack ``w [L, N, K]`` with ``layer=`` an int32
scalar (may be traced; the stack is read in place), or a Python int, compiled into the kernel (no load
of the index before the weights', but a kernel per layer). It accumulates in f32 and returns bf16:

* ``norm_weight`` (``[K]``, or ``[L, K]`` with a stacked ``w``): each row of ``x`` is first
  RMS-normalised over K in f32 and scaled by the weight, ``x * rsqrt(mean(x^2) + eps) * norm_weight``;
* ``epilogue=None``: ``y [R, N]``; ``"residual"``: ``y + residual`` for ``residual [R, N]``;
  ``"swiglu"``: ``w`` holds the gate's ``N / 2`` rows and then up's (a checkpoint's fused gate_up) and
  the result is ``silu(gate) * up``, ``[R, N / 2]``.

``gemv_reference`` is the jnp reference of the same signature. Shapes the config cannot tile raise
``ValueError`` (``K`` a multiple of ``block_k``, the outputs of ``block_n``, both powers of two), as does
a weight or stack of ``2**31`` elements or more (the kernel's element offsets are int32).

Why Triton. At batch 1 a projection multiplies each weight element once: its speed is the rate at
which loads keep HBM busy, and the norm before and the add or SwiGLU after belong in the same kernel
(no small kernels between). A Mosaic GPU kernel reads global memory through TMA into shared memory,
and at these sizes that streamed Qwen3-0.6B's weights more slowly than plain wide loads into registers
(XLA's own row reduction, or this kernel) do (docs/benchmarks.md, session 51).

Algorithm. Grid ``(N_out / block_n,)``: a program owns ``block_n`` outputs (with SwiGLU, their gate
rows and the matching up rows) for every row of x. It walks K in ``block_k`` chunks, unrolled, and
loads each weight tile once, adding ``w[outputs, chunk] * x[r, chunk]`` into an f32
``[block_n, block_k]`` accumulator per row r (with a norm, x is first scaled by the norm weight and
its squares are summed), then sums across K once. The multiply-adds are on the CUDA cores, R per
weight element: a few rows stay bound by HBM; many rows would want tensor cores instead. The norm is linear
in x, so its ``rsqrt(mean(x^2) + eps)`` scales the sums; the product is rounded to bf16 as the model's
would be, then the residual is added or ``silu(gate) * up`` taken, and the program stores its outputs.
On the CPU (tests) it runs in Pallas's interpreter (``interpret=True``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["MAX_ELEMENTS", "MAX_ROWS", "GemvConfig", "gemv", "gemv_reference"]

EPILOGUES = (None, "residual", "swiglu")
MAX_ELEMENTS = 2**31  # a weight (stack) at least this large: int32 element offsets would overflow
MAX_ROWS = 32  # rows of x: each is its own accumulator per weight tile, in registers


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """``block_n``: outputs a program; ``block_k``: K's chunk a step; ``num_warps``: a program's warps."""

    block_n: int = 4
    block_k: int = 512
    num_warps: int = 8


def gemv_reference(x, w, *, layer=None, norm_weight=None, eps: float = 1e-6, epilogue=None, residual=None):
    """What ``gemv`` computes, in jnp: the model's math, its norm output and product rounded to bf16."""
    if layer is not None:
        w = w[layer]
        norm_weight = None if norm_weight is None else norm_weight[layer]
    v = x.astype(jnp.float32)
    if norm_weight is not None:
        v = v * lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps) * norm_weight.astype(jnp.float32)
        v = v.astype(jnp.bfloat16).astype(jnp.float32)
    y = jnp.dot(v, w.astype(jnp.float32).T).astype(jnp.bfloat16).astype(jnp.float32)
    if epilogue == "residual":
        y = y + residual.astype(jnp.float32)
    elif epilogue == "swiglu":
        gate, up = jnp.split(y, 2, axis=-1)
        y = jax.nn.silu(gate) * up
    return y.astype(jnp.bfloat16)


def _check_projection(x, w, layer, norm_weight, epilogue, residual, *, block_n: int, block_k: int) -> None:
    """ValueError naming what of the projection contract (module docstring) the arguments break, all but
    the row count of x, which the kernel bounds itself. Tiles: powers of two."""
    if (w.ndim == 3) != (layer is not None):
        raise ValueError(f"a stacked w [L, N, K] needs layer= and a w [N, K] takes none; got w{tuple(w.shape)} "
                         f"and layer={layer!r}")
    if isinstance(layer, int) and not 0 <= layer < w.shape[0]:
        raise ValueError(f"layer = {layer} is outside the stack's {w.shape[0]} layers")
    if w.ndim not in (2, 3) or w.shape[-1] != x.shape[1]:
        raise ValueError(f"w must be [N, K] or [L, N, K] with x's K = {x.shape[1]}, got {tuple(w.shape)}")
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"x and w must be bfloat16, got x {x.dtype} and w {w.dtype}")
    n, k = w.shape[-2:]
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    for name, value in (("block_n", block_n), ("block_k", block_k)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} = {value} must be a power of two")
    if w.size >= MAX_ELEMENTS:
        raise ValueError(f"w has {w.size} elements, >= 2**31: the kernel's int32 offsets would overflow")
    if k % block_k:
        raise ValueError(f"K = {k} is not a multiple of block_k = {block_k}")
    num_out = n // 2 if epilogue == "swiglu" else n
    if n % (2 if epilogue == "swiglu" else 1) or num_out % block_n:
        raise ValueError(f"N = {n} does not split into programs of block_n = {block_n} outputs"
                         + (" (gate and up halves)" if epilogue == "swiglu" else ""))
    if norm_weight is not None and norm_weight.shape != (*w.shape[:-2], k):
        raise ValueError(f"norm_weight must be {(*w.shape[:-2], k)}, got {tuple(norm_weight.shape)}")
    if (epilogue == "residual") != (residual is not None):
        raise ValueError("residual= is needed by, and only by, epilogue='residual'")
    if residual is not None and residual.shape != (x.shape[0], n):
        raise ValueError(f"residual must be [R, N] = {(x.shape[0], n)}, got {tuple(residual.shape)}")


def _as_stack(w, norm_weight):
    """A weight `[N, K]` (and its norm weight) as a stack of one layer: free reshapes, so that one code
    path serves a weight and a stack of them."""
    if w.ndim == 2:
        return w[None], None if norm_weight is None else norm_weight[None]
    return w, norm_weight


def _kernel(layer_ref, x_ref, w_ref, g_ref, r_ref, o_ref, *, rows, n, k, block_n, block_k, eps, norm, epilogue,
            static_layer):
    j = pl.program_id(0)
    # A traced layer is read first and every weight address waits for it; a static one is compiled in.
    layer = layer_ref[0] if static_layer is None else static_layer
    first = j * block_n
    num_out = n // 2 if epilogue == "swiglu" else n
    # Weight rows of the program's outputs in the [L * N, K] view: the gate's, then (SwiGLU) up's.
    starts = [layer * n + first] + ([layer * n + n // 2 + first] if epilogue == "swiglu" else [])
    # accs[t][r]: weight stream t (gate, up) times row r of x, each weight tile loaded once for every row.
    accs = [[jnp.zeros((block_n, block_k), jnp.float32)] * rows for _ in starts]
    squares = [jnp.zeros((1, block_k), jnp.float32)] * rows
    for c in range(k // block_k):
        cols = pl.ds(c * block_k, block_k)
        xs, g = [], None
        for r in range(rows):
            x = x_ref[pl.ds(r, 1), cols].astype(jnp.float32)  # [1, block_k]
            if norm:
                squares[r] = squares[r] + x * x
                if g is None:  # the norm weight's chunk, loaded once for every row
                    g = g_ref[pl.ds(layer, 1), cols].astype(jnp.float32)
                x = x * g
            xs.append(x)
        for t, start in enumerate(starts):
            w = w_ref[pl.ds(start, block_n), cols].astype(jnp.float32)
            accs[t] = [acc + w * x for acc, x in zip(accs[t], xs)]
    for r in range(rows):
        sums = [jnp.sum(acc[r], axis=1) for acc in accs]  # [block_n] each
        if norm:
            scale = lax.rsqrt(jnp.sum(squares[r]) / k + eps)
            sums = [s * scale for s in sums]
        sums = [s.astype(jnp.bfloat16).astype(jnp.float32) for s in sums]  # the product's bf16 result
        if epilogue == "residual":
            y = sums[0] + r_ref[pl.ds(r * n + first, block_n)].astype(jnp.float32)
        elif epilogue == "swiglu":
            gate, up = sums
            y = gate / (1 + jnp.exp(-gate)) * up
        else:
            y = sums[0]
        o_ref[pl.ds(r * num_out + first, block_n)] = y.astype(o_ref.dtype)


def gemv(x, w, *, layer=None, norm_weight=None, eps: float = 1e-6, epilogue=None, residual=None,
         config: GemvConfig | None = None, interpret=False):
    """``x [R, K] @ w.T`` (``w [N, K]``, or ``w[layer]`` of ``[L, N, K]``) in bf16 with f32 accumulation,
    with an RMSNorm of ``x`` before and a residual add or SwiGLU after (module docstring)."""
    if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be [R, K] with 1 <= R <= {MAX_ROWS} rows, got {tuple(x.shape)}")
    config = config or GemvConfig()
    _check_projection(x, w, layer, norm_weight, epilogue, residual, block_n=config.block_n, block_k=config.block_k)
    static_layer = layer if isinstance(layer, int) else None
    w, norm_weight = _as_stack(w, norm_weight)
    num_layers, n, k = w.shape
    rows = x.shape[0]
    num_out = n // 2 if epilogue == "swiglu" else n
    g = jnp.ones((1, k), jnp.bfloat16) if norm_weight is None else norm_weight.astype(jnp.bfloat16)
    r = jnp.zeros((1,), jnp.bfloat16) if residual is None else residual.astype(jnp.bfloat16).reshape(rows * n)
    kernel = functools.partial(_kernel, rows=rows, n=n, k=k, block_n=config.block_n, block_k=config.block_k,
                               eps=eps, norm=norm_weight is not None, epilogue=epilogue, static_layer=static_layer)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows * num_out,), jnp.bfloat16),
        grid=(num_out // config.block_n,),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
        name="gemv_triton",
    )(jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1), x, w.reshape(num_layers * n, k), g, r)
    return out.reshape(rows, num_out)
