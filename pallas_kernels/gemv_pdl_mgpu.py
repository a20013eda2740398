"""Decode's one-row projection on Mosaic GPU that loads its weights while the kernel before it still
runs (programmatic dependent launch, PDL), with the layer's RMSNorm before it and a residual add or
SwiGLU after it.

Contract: ``gemv_triton.gemv``'s for one row of x (``x [1, K]``, a weight ``[N, K]`` or a stack read in
place at ``layer=``, ``norm_weight``, ``epilogue`` ``None`` / ``"residual"`` / ``"swiglu"``;
``gemv_triton.gemv_reference`` is the reference), with K a multiple of 256 and ``block_n`` outputs a CTA.
With PDL the kernel reads ``layer`` before it waits, so the index must not be written by another kernel
of the program: a literal (an unrolled scan over numpy indices folds to one) or a parameter, not a
loop's counter.

Why. At batch 1 a projection streams its weight once: 4-12 MB for Qwen3-0.6B, a few microseconds at
HBM speed, so the time a kernel takes to start and to reach full bandwidth is a large part of it, and
one kernel starts only when the one before it has ended. On Hopper a kernel launched with programmatic
stream serialization may start before the kernel before it ends. The weights are read-only (no earlier
kernel writes them), so a CTA can copy its weight rows (and the norm weight) into shared memory right
away; it then runs ``griddepcontrol.wait``, which returns once the earlier kernels have finished and
their writes are visible, and only then reads x and the residual. Each CTA also lets the next kernel
launch as soon as it starts (``griddepcontrol.launch_dependents``; that kernel's own wait still holds it
until this one has finished), so a chain of these kernels (o, gate_up, down, the next layer's qkv)
keeps weights streaming across kernel boundaries. ``GemvPdlConfig.pdl=False`` is the same kernel
launched the usual way (the A/B of benchmarks.gemv_chain).

Algorithm. Grid ``(N_out / block_n,)`` (with SwiGLU a CTA owns ``block_n`` gate rows and the matching up
rows), one warpgroup a CTA. The CTA's whole ``[block_n, K]`` weight goes to shared memory in 256-wide
chunks, one TMA copy and one barrier a chunk, so the products start on the first chunk while later ones
arrive; x (and the norm weight) come as one ``[K / 256, 1, 256]`` copy. Each thread owns 2 columns of a
chunk (the warpgroup's strided register layout): it multiplies each weight row's two by x's (times the
norm weight), adding into one f32 register pair a weight row; with a norm it also adds x^2. The pairs
are then summed across the warpgroup; the norm is linear in x, so ``rsqrt(mean(x^2) + eps)`` scales the
sums. The product is rounded to bf16 as the model's would be, the residual added or ``silu(gate) * up``
taken, and the CTA stores its outputs with one TMA copy. On the CPU (tests) it runs in Mosaic GPU's
interpreter, which has no PDL: there the grid-dependency instructions are left out.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gemv_triton import as_stack, check_projection

__all__ = ["CHUNK", "GemvPdlConfig", "gemv"]

CHUNK = 256  # K's chunk a TMA copy: a warpgroup's 128 threads x 2 columns (a TMA box is at most 256 wide)
SMEM_BYTES = 200 * 1024  # what the CTA's staged weight may take of an H100's 227 KB of shared memory


@dataclasses.dataclass(frozen=True)
class GemvPdlConfig:
    """``block_n``: outputs a CTA (a multiple of 8: its output row is one TMA store of at least 16 bytes);
    ``pdl``: launch with programmatic dependent launch and copy the weights before waiting."""

    block_n: int = 8
    pdl: bool = True


def _kernel(layer_gmem, x_gmem, w_gmem, *rest, block_n, chunks, k, eps, norm, epilogue, pdl):
    rest = list(rest)
    g_gmem = rest.pop(0) if norm else None
    r_gmem = rest.pop(0) if epilogue == "residual" else None
    (out_gmem,) = rest
    j = lax.axis_index("n")
    if pdl:  # the next kernel may launch now: its wait still holds it until this grid has finished
        plgpu.griddepcontrol_launch_dependents()
    layer = layer_gmem[0]  # a constant of the program, never written by an earlier kernel
    streams = 2 if epilogue == "swiglu" else 1  # SwiGLU: the gate's rows, then up's, N / 2 further
    half = w_gmem.shape[1] // streams
    layout = plgpu.Layout.WG_STRIDED((CHUNK,), vec_size=2)
    zero = plgpu.layout_cast(jnp.zeros((CHUNK,), jnp.float32), layout)
    scratch = dict(w_smem=plgpu.SMEM((streams, chunks, block_n, CHUNK), jnp.bfloat16),
                   x_smem=plgpu.SMEM((chunks, 1, CHUNK), jnp.bfloat16),
                   o_smem=plgpu.SMEM((1, block_n), out_gmem.dtype),
                   w_bars=plgpu.Barrier(num_barriers=streams * chunks), x_bar=plgpu.Barrier())
    if norm:
        scratch |= dict(g_smem=plgpu.SMEM((chunks, 1, CHUNK), jnp.bfloat16), g_bar=plgpu.Barrier())
    if epilogue == "residual":
        scratch |= dict(r_smem=plgpu.SMEM((1, block_n), out_gmem.dtype), r_bar=plgpu.Barrier())

    @functools.partial(pl.run_scoped, **scratch)
    def _body(w_smem, x_smem, o_smem, w_bars, x_bar, g_smem=None, g_bar=None, r_smem=None, r_bar=None):
        # Read-only inputs first: the weight rows chunk by chunk, and the norm weight.
        for c in range(chunks):
            for t in range(streams):
                rows = pl.ds(t * half + j * block_n, block_n)
                plgpu.copy_gmem_to_smem(w_gmem.at[layer, rows, pl.ds(c * CHUNK, CHUNK)], w_smem.at[t, c],
                                        w_bars.at[t * chunks + c])
        if norm:
            plgpu.copy_gmem_to_smem(g_gmem.at[layer], g_smem, g_bar)
        if pdl:  # x and the residual are earlier kernels' outputs
            plgpu.griddepcontrol_wait()
        plgpu.copy_gmem_to_smem(x_gmem, x_smem, x_bar)
        if epilogue == "residual":
            plgpu.copy_gmem_to_smem(r_gmem.at[:, pl.ds(j * block_n, block_n)], r_smem, r_bar)
        plgpu.barrier_wait(x_bar)
        if norm:
            plgpu.barrier_wait(g_bar)
        sums, square = [zero] * (streams * block_n), zero
        for c in range(chunks):
            x = x_smem[c, 0, :].astype(jnp.float32)
            if norm:
                square = square + x * x
                x = x * g_smem[c, 0, :].astype(jnp.float32)
            for t in range(streams):
                plgpu.barrier_wait(w_bars.at[t * chunks + c])
                for r in range(block_n):
                    i = t * block_n + r
                    sums[i] = sums[i] + w_smem[t, c, r, :].astype(jnp.float32) * x
        totals = [jnp.sum(s) for s in sums]  # across the warpgroup
        if norm:  # linear in x: the scale applies to the sums
            scale = lax.rsqrt(jnp.sum(square) / k + eps)
            totals = [s * scale for s in totals]
        outs = [s.astype(jnp.bfloat16).astype(jnp.float32) for s in totals]  # the product's bf16 result
        if epilogue == "residual":
            plgpu.barrier_wait(r_bar)
            outs = [o + r_smem[0, r].astype(jnp.float32) for r, o in enumerate(outs)]
        elif epilogue == "swiglu":
            outs = [g / (1 + jnp.exp(-g)) * u for g, u in zip(outs[:block_n], outs[block_n:])]
        for r, o in enumerate(outs):
            o_smem[0, r] = o.astype(out_gmem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[:, pl.ds(j * block_n, block_n)])
        plgpu.wait_smem_to_gmem(0)


def gemv(x, w, *, layer=None, norm_weight=None, eps: float = 1e-6, epilogue=None, residual=None,
         config: GemvPdlConfig | None = None, interpret=False):
    """``x [1, K] @ w.T`` (``w [N, K]``, or ``w[layer]`` of ``[L, N, K]``) in bf16 with f32 accumulation,
    with an RMSNorm of ``x`` before and a residual add or SwiGLU after (module docstring).

    ``interpret``: Mosaic GPU's interpreter (CPU tests), ``True`` or a ``plgpu.InterpretGPUParams``."""
    config = config or GemvPdlConfig()
    if x.ndim != 2 or x.shape[0] != 1:
        raise ValueError(f"x must be one row [1, K], got {tuple(x.shape)}")
    if config.block_n < 8 or config.block_n % 8:
        raise ValueError(f"block_n = {config.block_n} must be a multiple of 8 (a 16-byte output store)")
    check_projection(x, w, layer, norm_weight, epilogue, residual, block_n=config.block_n, block_k=CHUNK)
    w, norm_weight = as_stack(w, norm_weight)
    n, k = w.shape[1:]
    streams = 2 if epilogue == "swiglu" else 1
    staged = streams * config.block_n * k * 2
    if staged > SMEM_BYTES:
        raise ValueError(f"a CTA's {streams * config.block_n} weight rows of K = {k} take {staged} bytes of "
                         f"shared memory, more than {SMEM_BYTES}: lower block_n")
    chunks = k // CHUNK
    num_out = n // streams
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    kernel = plgpu.kernel(
        functools.partial(_kernel, block_n=config.block_n, chunks=chunks, k=k, eps=eps,
                          norm=norm_weight is not None, epilogue=epilogue, pdl=config.pdl and not interpret),
        out_type=jax.ShapeDtypeStruct((1, num_out), jnp.bfloat16),
        grid=(num_out // config.block_n,),
        grid_names=("n",),
        interpret=interpret or None,
        kernel_name="gemv_pdl_mgpu",
    )
    as_chunks = lambda a: a.reshape(*a.shape[:-1], chunks, 1, CHUNK)  # noqa: E731  [.., K] -> [.., K/256, 1, 256]
    operands = [jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1), as_chunks(x[0]), w]
    if norm_weight is not None:
        operands.append(as_chunks(norm_weight.astype(jnp.bfloat16)))
    if residual is not None:
        operands.append(residual.astype(jnp.bfloat16))
    return kernel(*operands)
