"""Skinny GEMM ``y = x @ w`` for decode's few rows, streaming the weight (Pallas, Mosaic GPU backend).

Contract. ``skinny_matmul(x, w)`` takes ``x [M, K]`` bf16 with ``1 <= M <= 32`` and a projection
weight ``w [K, N]`` bf16 (the engine's layout: ``y = x @ w``), accumulates in f32 and returns
``y [M, N]`` bf16; ``skinny_matmul_reference`` is its jnp reference. ``w`` may also be a stack of
layers' weights ``[L, K, N]`` with ``layer=`` an int32 scalar (may be traced): the product is then
with ``w[layer]``, read in place (slicing the stack first would make XLA copy the slice for the
custom call). ``K`` must divide into
``tile_k``-tiles and those evenly among the splits, ``N`` into ``tile_n``-tiles (the default
configs need ``K % 64 == 0`` and ``N % 64 == 0``); anything else raises ``ValueError``.

Why. At decode every projection reads its weight once per step with only 1-32 rows to multiply
it by, so it is bound by HBM bandwidth: the aim is to keep enough bytes in flight on every SM to
stream the weight at copy bandwidth. A GEMM tiled over the output alone has too few CTAs for
that: a 1024-wide output in 64-wide tiles makes 16 CTAs for 132 SMs.

Algorithm. The weight is the big operand, so it sits on wgmma's M side and the rows on its
(small) N side: each CTA computes ``y^T[n-tile, :] = w^T[n-tile, k-range] @ x^T[k-range, :]``.

* Rows: ``x`` is zero-padded to ``mpad`` = 8, 16 or 32 rows (the smallest that holds M; wgmma's
  N dimension takes multiples of 8), so the tensor cores do at most 4x the needed work, which
  costs nothing next to the weight's bytes.
* Grid ``(N / tile_n, splits)``: CTA ``(i, s)`` owns output columns ``[i*tile_n, (i+1)*tile_n)``
  and the ``s``-th of ``splits`` equal ranges of K, ``steps = K / tile_k / splits`` tiles long.
  Splitting K is what gives a narrow projection enough CTAs.
* Pipeline: ``plgpu.emit_pipeline`` over the ``steps`` tiles streams the CTA's weight slab
  ``w[k-tile, n-tile]`` (``[tile_k, tile_n]``, N contiguous) and the matching ``[mpad, tile_k]``
  tile of x (tiny, read from L2) through shared memory with TMA, ``max_concurrent_steps`` stages
  deep. Each step issues one wgmma with A = the weight tile viewed transposed (``[tile_n,
  tile_k]``, MN-major, which wgmma reads for 16-bit types) and B = the x tile viewed transposed
  (``[tile_k, mpad]``, K-major), into a ``[tile_n, mpad]`` f32 accumulator in registers. After
  issuing its wgmma a step waits until at most that one is pending (``wgmma_wait(1)``), and the
  pipeline refills the previous step's stage only then (``delay_release=1``): a TMA never
  overwrites a tile that a wgmma still reads, and each wgmma runs while the next step waits for
  its tile. So ``max_concurrent_steps - 1`` weight tiles are in flight per CTA in steady state
  (with a single stage: ``wgmma_wait(0)``, no delay).
* Partials: each CTA stores its accumulator through shared memory (one TMA store) to
  ``partials[s, n-tile, :]`` of an f32 ``[splits, N, mpad]`` array, i.e. transposed partial
  outputs. The wrapper then sums over the splits (as adds of slices, elementwise, so that XLA may
  fuse the sum into the consumer's fusion), drops the padding rows, transposes and casts to bf16
  with jnp, reading ``splits * N * mpad * 4`` bytes. With one
  split the CTA stores bf16 ``y^T`` itself and nothing is left to sum: the wrapper's slice and
  transpose can join the consumer's fusion. (The padding
  of x is a second tiny op, and none at 8, 16 or 32 rows.)

Default config (``default_config``), for ``num_sms`` SMs (the device's count on a GPU, else the
H200's 132): at least ``ctas_per_sm * num_sms`` CTAs (``ctas_per_sm = 2``), so that every SM
holds a few CTAs' loads in flight at once (a CTA at the defaults takes 56 KB of shared memory at
32 rows, 96 KB with 128-wide tiles, so 2-4 fit on an SM):

* ``tile_k = 64`` (one 128-byte swizzled row of x per tile).
* ``tile_n = 128`` when ``N / 128`` alone gives the target CTA count (the LM head), else 64.
* ``splits`` = the smallest divisor of ``K / tile_k`` that gives at least the target CTAs
  (``ceil(target / (N / tile_n))``), unless that leaves less than ``4 * mpad`` of K per split:
  then the largest divisor that leaves at least that. The partials are ``2 * mpad / (K / splits)``
  of the weight's bytes (written and read back once, mostly in L2): the cap keeps them within
  half.
* ``max_concurrent_steps = min(steps, 4)`` (at most 4 x 8-16 KB of weight per stage set).

Constraints of the Mosaic GPU lowering (the interpreter accepts more): wgmma's M dimension is a
multiple of 64 ("the accumulator's first dimension must be a multiple of 64"), so ``tile_n`` is a
multiple of 64; ``tile_k`` is a multiple of 16 (wgmma's K for bf16); both operands must be bf16
(the 16-bit types are the ones wgmma reads MN-major); the stages, the x tiles and the output tile
must fit in shared memory (227 KB), which the lowering checks.

On the CPU (tests) the kernel runs in Mosaic GPU's interpreter (``interpret=True``), which checks
reads against the buffers' bounds (and, asked to, races between TMA copies and accesses) but not
the real lowering's layouts, and runs wgmma synchronously; lowering for CUDA on any backend
(``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``) runs Mosaic GPU's layout
inference and lowering down to wgmma and TMA instructions, which checks the rest short of PTX.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mgpu_common import check_weight_tile, device_sm_count

__all__ = ["SkinnyConfig", "accepts", "default_config", "skinny_matmul", "skinny_matmul_reference"]

MAX_ROWS = 32  # the largest M the kernel takes (its accumulator is [tile_n, 32] at most)
_ROW_PADS = (8, 16, 32)  # wgmma's N dimension takes multiples of 8


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """The kernel's tiling: ``grid = (N / tile_n, splits)``, each CTA ``K / tile_k / splits`` steps."""

    tile_n: int = 64
    tile_k: int = 64
    splits: int = 1
    max_concurrent_steps: int = 4


def padded_rows(m: int) -> int:
    """The rows the kernel computes for ``m`` real ones (the wgmma N dimension)."""
    return next(p for p in _ROW_PADS if p >= m)


def default_config(m: int, k: int, n: int, *, num_sms: int | None = None, ctas_per_sm: int = 2,
                   tile_k: int = 64, tile_n: int | None = None, splits: int | None = None) -> SkinnyConfig:
    """The config for an ``[m, k] @ [k, n]`` product (the rule in the module docstring); the keyword
    arguments change the rule's constants (the benchmark's variants); ``splits`` given is taken as is."""
    target = (num_sms or device_sm_count()) * ctas_per_sm
    if tile_n is None:
        tile_n = 128 if n % 128 == 0 and n // 128 >= target else 64
    n_tiles, k_tiles = n // tile_n, k // tile_k
    if n_tiles == 0 or k_tiles == 0:
        return SkinnyConfig(tile_n=tile_n, tile_k=tile_k)  # refused with a message by skinny_matmul
    divisors = [d for d in range(1, k_tiles + 1) if k_tiles % d == 0]
    want = -(-target // n_tiles)
    cap = k // (4 * padded_rows(min(max(m, 1), MAX_ROWS)))
    if splits is None:
        splits = min([d for d in divisors if d >= want] + [k_tiles])
        if splits > cap:
            splits = max([d for d in divisors if d <= cap] + [1])
    steps = k_tiles // splits
    return SkinnyConfig(tile_n=tile_n, tile_k=tile_k, splits=splits, max_concurrent_steps=min(steps, 4))


def accepts(x, w) -> bool:
    """Whether ``skinny_matmul(x, w)`` takes these shapes and dtypes with its default config (``w`` one
    layer's ``[K, N]``); callers fall back to another product where it does not."""
    if x.ndim != 2 or w.ndim != 2:
        return False
    try:
        _check(x, w, default_config(x.shape[0], x.shape[1], w.shape[1]))
    except ValueError:
        return False
    return True


def _check(x, w, config: SkinnyConfig) -> None:
    """``w`` here is one layer's ``[K, N]`` (the stack's shape without its leading axis)."""
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"x must be [M, K] and w [K, N], got x{tuple(x.shape)} and w{tuple(w.shape)}")
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"x and w must be bfloat16, got x {x.dtype} and w {w.dtype}")
    m, k = x.shape
    k2, n = w.shape
    if k != k2:
        raise ValueError(f"x's K = {k} differs from w's K = {k2}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"M = {m} rows: the skinny kernel takes 1 to {MAX_ROWS}")
    c = config
    check_weight_tile(c.tile_n, c.tile_k)
    if n % c.tile_n:
        raise ValueError(f"N = {n} is not divisible by tile_n = {c.tile_n}")
    if k % c.tile_k:
        raise ValueError(f"K = {k} is not divisible by tile_k = {c.tile_k}")
    if c.splits < 1 or (k // c.tile_k) % c.splits:
        raise ValueError(f"splits = {c.splits} must divide K / tile_k = {k // c.tile_k}")
    if c.max_concurrent_steps < 1:
        raise ValueError(f"max_concurrent_steps = {c.max_concurrent_steps} must be positive")


def _skinny_kernel(layer_gmem, x_gmem, w_gmem, out_gmem, *, tile_n, tile_k, steps, stages, mpad):
    ni = lax.axis_index("n")
    w_gmem = w_gmem.at[layer_gmem[0]]  # this layer's [K, N] of the [L, K, N] stack
    first = lax.axis_index("s") * steps  # the split's first K tile
    # A stage is refilled one step after its wgmma was issued, once wgmma_wait(1) saw it finish;
    # a single stage has no later step to release it in.
    delay = 1 if stages > 1 else 0

    def step(_, w_smem, x_smem, acc_ref):
        plgpu.wgmma(acc_ref, w_smem.T, x_smem.T)
        plgpu.wgmma_wait(delay)
        return acc_ref

    def acc_scope(acc_ref):
        plgpu.emit_pipeline(
            functools.partial(step, acc_ref=acc_ref),
            grid=(steps,),
            in_specs=[
                plgpu.BlockSpec((tile_k, tile_n), lambda j: (first + j, ni), delay_release=delay),
                plgpu.BlockSpec((mpad, tile_k), lambda j: (0, first + j), delay_release=delay),
            ],
            max_concurrent_steps=stages,
        )(w_gmem, x_gmem)
        return acc_ref[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((tile_n, mpad), jnp.float32))

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((tile_n, mpad), out_gmem.dtype))
    def _store(o_smem):
        o_smem[...] = acc.astype(out_gmem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[lax.axis_index("s"), pl.ds(ni * tile_n, tile_n)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def skinny_partials(x_padded, w, config: SkinnyConfig, *, layer=0, interpret=False):
    """The kernel alone: ``[splits, N, mpad]`` partial ``y^T`` of each K split (f32; bf16 with one
    split, which is then the product), for an already
    padded ``x_padded [mpad, K]`` (``mpad`` in 8, 16, 32) and ``w`` ``[K, N]`` or ``[L, K, N]``
    (then at ``layer``)."""
    if w.ndim == 2:
        w = w[None]  # a free reshape: one code path for a weight and a stack of them
    mpad, k = x_padded.shape
    n = w.shape[2]
    k_tiles = k // config.tile_k
    steps = k_tiles // config.splits
    if interpret is True:
        # Mosaic GPU's own interpreter: Pallas' generic one cannot run the grid's axis_index.
        interpret = plgpu.InterpretGPUParams()
    kernel = plgpu.kernel(
        functools.partial(_skinny_kernel, tile_n=config.tile_n, tile_k=config.tile_k, steps=steps,
                          stages=min(config.max_concurrent_steps, steps), mpad=mpad),
        out_type=jax.ShapeDtypeStruct((config.splits, n, mpad), jnp.float32 if config.splits > 1 else jnp.bfloat16),
        grid=(n // config.tile_n, config.splits),
        grid_names=("n", "s"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret or None,
    )
    return kernel(jnp.asarray(layer, jnp.int32).reshape(1), x_padded, w)


def skinny_matmul(x, w, *, layer=None, config: SkinnyConfig | None = None, interpret=False):
    """``x [M, K] @ w [K, N]`` (or ``@ w[layer]`` of a stack) in bf16 with f32 accumulation, for ``M <= 32``.

    Args:
      x: ``[M, K]`` bf16, ``1 <= M <= 32``.
      w: ``[K, N]`` bf16, or ``[L, K, N]`` with ``layer``.
      layer: with a stacked ``w``, the layer to multiply by: an int32 scalar, may be traced (its
        range is not checked on the device: a layer outside ``[0, L)`` reads out of bounds).
      config: the tiling; ``default_config(M, K, N)`` when None.
      interpret: run Mosaic GPU's interpreter on the CPU (CPU tests): ``True`` for its default
        ``plgpu.InterpretGPUParams()``, or such an instance.

    Returns:
      ``y [M, N]`` bf16.
    """
    if (w.ndim == 3) != (layer is not None):
        raise ValueError(f"a stacked w [L, K, N] needs layer= and a w [K, N] takes none; got w{tuple(w.shape)} "
                         f"and layer={layer!r}")
    if isinstance(layer, int) and not 0 <= layer < w.shape[0]:
        raise ValueError(f"layer = {layer} is outside the stack's {w.shape[0]} layers")
    one = jax.ShapeDtypeStruct(w.shape[1:], w.dtype) if w.ndim == 3 else w  # one layer's weight, to check
    if config is None and x.ndim == 2 and one.ndim == 2:
        config = default_config(x.shape[0], x.shape[1], one.shape[1])
    config = config or SkinnyConfig()
    _check(x, one, config)
    m, k = x.shape
    mpad = padded_rows(m)
    x_padded = jnp.pad(x, ((0, mpad - m), (0, 0)))
    partials = skinny_partials(x_padded, w, config, layer=0 if layer is None else layer, interpret=interpret)
    # The splits summed as adds of slices, not a reduce: elementwise ops that XLA may fuse, with the
    # slice and the transpose, into the consumer's own fusion (a reduce would be a kernel of its own).
    splits = [partials[s, :, :m] for s in range(partials.shape[0])]
    return functools.reduce(jnp.add, splits).T.astype(jnp.bfloat16)


def skinny_matmul_reference(x, w):
    """``x @ w`` with f32 accumulation, bf16 out: what ``skinny_matmul`` computes."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
