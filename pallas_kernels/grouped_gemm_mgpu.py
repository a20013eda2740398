"""Grouped GEMM for mixture-of-experts layers, streaming each expert's weight (Pallas, Mosaic GPU backend).

Contract. ``grouped_gemm_mgpu(lhs, rhs, group_sizes)`` has exactly ``grouped_gemm.grouped_gemm``'s
(the Triton kernel's) contract, i.e. ``jax.lax.ragged_dot``'s semantics: ``lhs [M, K]`` bf16 holds
rows sorted by group, ``rhs [G, K, N]`` bf16 every group's weight, ``group_sizes [G]`` int32; rows
``[off_g, off_g + group_sizes[g])`` are multiplied by ``rhs[g]`` (``off_g`` the sum of the sizes
before ``g``; negative sizes count as 0, sizes past ``M`` are clipped), accumulated in f32 and
returned as ``out [M, N]`` bf16; rows past ``sum(group_sizes)`` come out as zeros. An empty group
has no row tile: its weight is never read. ``grouped_gemm.grouped_gemm_reference`` is the
reference. ``K`` must divide into ``tile_k``-tiles and ``N`` into ``tile_n``-tiles (the default
configs need ``K % 16 == 0`` and ``N % 64 == 0``); anything else raises ``ValueError``. FP8
block-scaled weights as in the Triton kernel: ``rhs`` float8_e4m3fn with ``rhs_scale [G, cdiv(K,
sb), cdiv(N, sb)]`` float32 (``sb = scale_block``, 128 in the checkpoints), dequantised in the
kernel as the reference does (``bf16(w * scale)``).

Why. At decode every expert gets a handful of rows (128 tokens x top-8 over 128 experts: ~8 rows
each) while its weight must be read whole, so each routed GEMM streams the weights of every expert
that got a row, once per step: it is bound by HBM bandwidth and the aim is to keep enough weight
bytes in flight on every SM. The Triton kernel tiles rows on the MMA's M side (16 at least, mostly
padding at decode) and stays far from that bound.

Algorithm. The weight is the big operand, so it sits on wgmma's M side and the group's rows on its
(small) N side: a CTA computes ``out^T[n-tile, rows] = rhs[g]^T[n-tile, :] @ lhs[rows, :]^T``.

* Row tiles: each group's rows are cut into tiles of ``row_tile`` rows (8..64, a multiple of 8:
  wgmma's N). A tile's rows are read from an 8-aligned row ``base`` (the TMA of a tiled,
  swizzled shared-memory tile needs its global row offset to be a multiple of the 8-row tiling),
  so a group's first tile starts at its first row rounded down to 8 and holds the rows of the
  group in ``[lo, lo + count)`` of its ``row_tile``; the other rows belong to neighbouring groups
  and are computed but never stored. ``base`` is clipped to ``M8 - row_tile`` (``M8``: ``M``
  rounded up to 8 and at least ``row_tile``; ``lhs`` is zero-padded to ``M8`` rows when that
  differs from ``M``), so no read leaves ``lhs``. A decode step fits each group in one tile (the
  default ``row_tile`` is about twice the mean group size plus the alignment slack); a bigger
  group (prefill, or a popular expert) gets more tiles, each streaming the group's weight again:
  correct, and at prefill sizes compute- rather than bandwidth-bound.
* Schedule: a tiny jnp prologue (``tile_schedule``) lists per tile its group (``G``: the rows past
  ``sum(group_sizes)``, stored as zeros; ``-1``: an idle tile), ``base``, ``lo`` and ``count``.
  Its length ``num_tiles`` is the static upper bound ``n + (M + 6 n) // row_tile`` for
  ``n = min(G + 1, M)`` non-empty groups (the zero tail included): a group of ``s`` rows starting
  ``o <= 7`` rows past an 8-aligned row takes ``ceil((s + o) / row_tile)`` tiles.
* Grid ``(N / tile_n, num_tiles)``: CTA ``(i, t)`` owns output columns ``[i*tile_n, (i+1)*tile_n)``
  of tile ``t``'s rows. The CTAs of one row tile run next to each other (the grid's first axis
  varies fastest) and read the same rows of ``lhs`` (from L2) and adjacent columns of ``rhs[g]``.
* Pipeline: ``plgpu.emit_pipeline`` over ``K / tile_k`` steps streams the weight slab
  ``rhs[g, k-tile, n-tile]`` (``[tile_k, tile_n]``, N contiguous) and the ``[row_tile, tile_k]``
  tile of ``lhs`` through shared memory with TMA, ``max_concurrent_steps`` stages deep. Each step
  issues one wgmma with A = the weight tile viewed transposed (``[tile_n, tile_k]``, MN-major,
  which wgmma reads for 16-bit types) and B = the row tile viewed transposed (``[tile_k,
  row_tile]``) into a ``[tile_n, row_tile]`` f32 accumulator in registers, then waits until at most
  that wgmma is pending (``wgmma_wait(1)``); the pipeline refills the previous step's stage only
  then (``delay_release=1``), so ``max_concurrent_steps - 1`` weight tiles are in flight per CTA.
* Store: the accumulator, cast to bf16, is stored transposed into a ``[row_tile, tile_n]``
  shared-memory tile (a store through the transposed view of the buffer), and its rows ``[lo, lo +
  count)`` go to ``out[base + lo :, n-tile]`` with one TMA store per set bit of ``count`` (a
  ladder of copies of 2^j rows: a TMA copy's shape is static, the count is not). The zero tail's
  tiles skip the pipeline and store zeros the same way; idle tiles do nothing. No epilogue in XLA:
  the kernel writes every row of ``out`` once.
* FP8 weights: wgmma reads 8-bit operands only K-major, and the weight tile is MN-major on its M
  side. So each step loads the FP8 tile from shared memory into registers, multiplies it by its
  block's scale (one scalar: ``tile_k`` and ``tile_n`` divide ``scale_block``; read from global
  memory, an L2 hit), stores it as bf16 into one of two bf16 tiles in shared memory (the other
  one may still be read by the previous step's wgmma) and issues the bf16 wgmma from there. The
  weights stay FP8 in HBM: half the bytes to stream; the conversion is register work overlapped
  with the TMA copies in flight.

Default config (``default_config``) for ``num_sms`` SMs (the device's count on a GPU, else the
H200's 132):

* ``row_tile``: the smallest of 8, 16, 32, 64 that holds ``ceil(2 M / G) + 7`` rows (twice the
  mean group plus the 8-row alignment slack), at most 64: 32 for a 128-token decode step of
  Qwen3-30B-A3B (1024 rows over 128 experts), 64 from about 200 tokens on.
* ``tile_n = 128`` when the groups that can have rows (``min(G, M)``) times ``N / 128`` give at
  least ``2 * num_sms`` CTAs (a CTA at 128 holds 48-112 KB of shared memory, so 2-4 fit on an SM),
  else 64.
* ``tile_k``: 64 (a 128-byte swizzled row of ``lhs`` per tile) or the largest of 32, 16 that
  divides ``K``.
* ``max_concurrent_steps = min(K / tile_k, 4)`` (3 at ``row_tile = 64``, to leave room for two
  CTAs per SM). The same rule for FP8 weights (their stages are half the size; the two bf16 tiles
  add ``2 * tile_k * tile_n * 2`` bytes).

The weights are read once per row tile, so a step that gives each group one tile reads
``(experts with rows) * K * N * 2`` bytes and writes ``M * N * 2``, plus the rows of ``lhs`` (from
L2 after the first n-tile). K is not split: with every expert of a decode batch receiving rows
there are ``G * N / tile_n`` busy CTAs (1536 and 2048 for the two Qwen3-30B-A3B GEMMs); a batch
that reaches only a few experts has fewer.

Constraints of the Mosaic GPU lowering (the interpreter accepts more): wgmma's M dimension is a
multiple of 64, so ``tile_n`` is; ``tile_k`` is a multiple of 16 (wgmma's K for bf16); ``row_tile``
a multiple of 8 in [8, 256] (wgmma's N); both wgmma operands bf16 (the 16-bit types are the ones
wgmma reads MN-major, hence the FP8 weights' conversion in shared memory); the row tile's global
offset must be provably a multiple of 8 (``pl.multiple_of``: layout inference otherwise asks for an
untiled, unswizzled tile that wgmma cannot read); the output tile is stored transposed into an
untiled buffer, which the ladder's dynamic row slices need; the stages and the output tile must fit
in shared memory (227 KB), which the lowering checks.

On the CPU (tests) the kernel runs in Mosaic GPU's interpreter (``interpret=True``), which checks
reads against the buffers' bounds but not the real lowering's layouts, and runs wgmma
synchronously; lowering for CUDA on any backend (``jax.jit(f).trace(...).lower(
lowering_platforms=("cuda",))``) runs Mosaic GPU's layout inference and lowering down to wgmma and
TMA instructions, which checks the rest short of PTX.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mgpu_common import check_weight_tile, device_sm_count, one_kernel_per_shape

__all__ = ["GroupedConfig", "default_config", "grouped_gemm_mgpu", "num_tiles", "tile_schedule"]

_ROW_TILES = (8, 16, 32, 64)  # the default rule's row tiles (wgmma's N takes multiples of 8 up to 256)
_ALIGN = 8  # a row tile's first row is a multiple of this (the shared-memory tile's row tiling)


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    """The kernel's tiling: grid ``(N / tile_n, num_tiles)``, each CTA ``K / tile_k`` pipeline steps
    over ``row_tile`` rows of one group."""

    tile_n: int = 128
    tile_k: int = 64
    row_tile: int = 32
    max_concurrent_steps: int = 4


def default_config(m: int, k: int, n: int, g: int, *, num_sms: int | None = None,
                   ctas_per_sm: int = 2) -> GroupedConfig:
    """The config for ``M = m`` rows over ``g`` groups of ``[k, n]`` weights (the rule in the module
    docstring); ``ctas_per_sm`` changes the rule's CTA target."""
    target = (num_sms or device_sm_count()) * ctas_per_sm
    want = -(-2 * max(m, 1) // max(g, 1)) + _ALIGN - 1
    row_tile = next((r for r in _ROW_TILES if r >= want), _ROW_TILES[-1])
    busy_groups = max(1, min(g, m))
    tile_n = 128 if n % 128 == 0 and busy_groups * (n // 128) >= target else 64
    tile_k = next((t for t in (64, 32, 16) if k % t == 0), 64)
    stages = 3 if row_tile >= 64 else 4
    return GroupedConfig(tile_n=tile_n, tile_k=tile_k, row_tile=row_tile,
                         max_concurrent_steps=max(1, min(k // tile_k, stages)))


def num_tiles(m: int, g: int, row_tile: int) -> int:
    """The static bound on the row tiles of ``m`` rows in ``g`` groups plus the zero tail."""
    busy = min(g + 1, m)
    return busy + (m + (_ALIGN - 2) * busy) // row_tile


def tile_schedule(group_sizes, m: int, row_tile: int):
    """-> int32 ``[4 * num_tiles]``: per row tile its group (``G``: zero rows past the groups; -1:
    idle), its first row ``base`` (a multiple of 8, at most ``M8 - row_tile``), and the first row
    ``lo`` and the number ``count`` of its rows to store, relative to ``base``; concatenated."""
    g = group_sizes.shape[0]
    m8 = max(-(-m // _ALIGN) * _ALIGN, row_tile)
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])  # + the zero tail, group G
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    aligned = starts // _ALIGN * _ALIGN
    tiles = jnp.where(ends > starts, (ends - aligned + row_tile - 1) // row_tile, 0)
    tile_end = jnp.cumsum(tiles)
    t = jnp.arange(num_tiles(m, g, row_tile), dtype=jnp.int32)
    owner = jnp.searchsorted(tile_end, t, side="right", method="scan_unrolled").astype(jnp.int32)
    own = jnp.minimum(owner, g)  # owner == G + 1: past the last tile
    first = aligned[own] + (t - (tile_end[own] - tiles[own])) * row_tile
    row_lo = jnp.maximum(starts[own], first)
    row_hi = jnp.minimum(ends[own], first + row_tile)
    busy = owner <= g
    base = jnp.where(busy, jnp.minimum(first, m8 - row_tile), 0)
    group = jnp.where(busy, owner, -1)
    lo = jnp.where(busy, row_lo - base, 0)
    count = jnp.where(busy, row_hi - row_lo, 0)
    return jnp.concatenate([group, base, lo, count])


def _check(lhs, rhs, group_sizes, rhs_scale, config: GroupedConfig, scale_block: int) -> None:
    if lhs.ndim != 2 or rhs.ndim != 3:
        raise ValueError(f"lhs must be [M, K] and rhs [G, K, N], got lhs{tuple(lhs.shape)} and rhs{tuple(rhs.shape)}")
    if rhs_scale is None and (lhs.dtype != jnp.bfloat16 or rhs.dtype != jnp.bfloat16):
        raise ValueError(f"lhs and rhs must be bfloat16, got lhs {lhs.dtype} and rhs {rhs.dtype}"
                         + (" (FP8 weights need rhs_scale)" if rhs.dtype == jnp.float8_e4m3fn else ""))
    if rhs_scale is not None and (lhs.dtype != jnp.bfloat16 or rhs.dtype != jnp.float8_e4m3fn):
        raise ValueError(f"with rhs_scale, lhs must be bfloat16 and rhs float8_e4m3fn, got lhs {lhs.dtype} "
                         f"and rhs {rhs.dtype}")
    m, k = lhs.shape
    g, k2, n = rhs.shape
    if k != k2:
        raise ValueError(f"lhs's K = {k} differs from rhs's K = {k2}")
    if group_sizes.shape != (g,):
        raise ValueError(f"group_sizes must have shape ({g},) (one size per group of rhs), got {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers, got {group_sizes.dtype}")
    c = config
    check_weight_tile(c.tile_n, c.tile_k)
    if not 8 <= c.row_tile <= 256 or c.row_tile % 8:
        raise ValueError(f"row_tile = {c.row_tile} must be a multiple of 8 in [8, 256] (wgmma's N)")
    if n % c.tile_n:
        raise ValueError(f"N = {n} is not divisible by tile_n = {c.tile_n}")
    if k % c.tile_k:
        raise ValueError(f"K = {k} is not divisible by tile_k = {c.tile_k}")
    if c.max_concurrent_steps < 1:
        raise ValueError(f"max_concurrent_steps = {c.max_concurrent_steps} must be positive")
    if rhs_scale is not None:
        expected = (g, -(-k // scale_block), -(-n // scale_block))
        if tuple(rhs_scale.shape) != expected:
            raise ValueError(f"rhs_scale has shape {tuple(rhs_scale.shape)}, expected {expected} "
                             f"(one scale per {scale_block} x {scale_block} block of each group's weight)")
        if scale_block % c.tile_k or scale_block % c.tile_n:
            raise ValueError(f"tile_k = {c.tile_k} and tile_n = {c.tile_n} must divide scale_block = {scale_block} "
                             "(one scale per weight tile)")


def _store_rows(o_smem, out_gmem, row0, lo, count, col0, *, row_tile, tile_n):
    """Rows ``[lo, lo + count)`` of ``o_smem`` to ``out[row0 + lo :, col0 : col0 + tile_n]``: one TMA
    store per set bit of ``count`` (a copy's shape is static)."""
    start = lo
    for bit in reversed(range(row_tile.bit_length())):
        size = 1 << bit

        @pl.when(count & size != 0)
        def _copy(start=start, size=size):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, size)],
                                    out_gmem.at[pl.ds(row0 + start, size), pl.ds(col0, tile_n)])

        start = start + (count & size)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _grouped_kernel(meta_gmem, lhs_gmem, rhs_gmem, *rest, num_groups, tiles, steps, stages,
                    tile_n, tile_k, row_tile, scale_block, scale_shape):
    if scale_shape is None:
        (out_gmem,) = rest
    else:
        scale_gmem, out_gmem = rest
    ni = lax.axis_index("n")
    t = lax.axis_index("t")
    group = meta_gmem[t]
    base = pl.multiple_of(meta_gmem[tiles + t], _ALIGN)
    lo = meta_gmem[2 * tiles + t]
    count = meta_gmem[3 * tiles + t]
    col0 = ni * tile_n
    store = functools.partial(_store_rows, out_gmem=out_gmem, row0=base, lo=lo, count=count, col0=col0,
                              row_tile=row_tile, tile_n=tile_n)
    # A stage is refilled one step after its wgmma was issued, once wgmma_wait(1) saw it finish;
    # a single stage has no later step to release it in.
    delay = 1 if stages > 1 else 0

    def step(_, w_smem, x_smem, acc_ref):
        plgpu.wgmma(acc_ref, w_smem.T, x_smem.T)
        plgpu.wgmma_wait(delay)
        return acc_ref

    def step_fp8(idx, w_smem, x_smem, acc_ref, wide_smem):
        # wgmma reads 8-bit operands K-major only: the FP8 tile is scaled into a bf16 copy in
        # registers and shared memory, one of two so that the previous step's wgmma (still
        # pending after wgmma_wait(1)) keeps reading its own.
        j = idx[0]
        n_k, n_n = scale_shape
        scale = scale_gmem[(group * n_k + lax.div(j * tile_k, scale_block)) * n_n + lax.div(col0, scale_block)]
        wide = wide_smem.at[lax.rem(j, 2)]
        wide[...] = (w_smem[...].astype(jnp.float32) * scale).astype(wide.dtype)
        plgpu.commit_smem()
        return step(idx, wide, x_smem, acc_ref)

    def acc_scope(acc_ref, wide_smem=None):
        body = step if wide_smem is None else functools.partial(step_fp8, wide_smem=wide_smem)
        plgpu.emit_pipeline(
            functools.partial(body, acc_ref=acc_ref),
            grid=(steps,),
            in_specs=[
                plgpu.BlockSpec((tile_k, tile_n), lambda j: (j, ni), delay_release=delay),
                plgpu.BlockSpec((row_tile, tile_k), lambda j: (0, j), delay_release=delay),
            ],
            max_concurrent_steps=stages,
        )(rhs_gmem.at[group], lhs_gmem.at[pl.ds(base, row_tile)])
        return acc_ref[...]

    def compute(o_smem):
        acc_type = plgpu.ACC((tile_n, row_tile), jnp.float32)
        if scale_shape is None:
            acc = pl.run_scoped(acc_scope, acc_type)
        else:  # (a scope allocates registers or memory, not both)
            acc = pl.run_scoped(lambda wide: pl.run_scoped(functools.partial(acc_scope, wide_smem=wide), acc_type),
                                plgpu.SMEM((2, tile_k, tile_n), jnp.bfloat16))
        o_smem.T[...] = acc.astype(o_smem.dtype)  # transposed: the rows on the buffer's major axis
        plgpu.commit_smem()
        store(o_smem)

    def zeros(o_smem):
        o_smem[...] = jnp.zeros((row_tile, tile_n), o_smem.dtype)
        plgpu.commit_smem()
        store(o_smem)

    out_tile = plgpu.SMEM((row_tile, tile_n), out_gmem.dtype)

    @pl.when((group >= 0) & (group < num_groups))
    def _compute():
        pl.run_scoped(compute, out_tile)

    @pl.when(group == num_groups)
    def _zero_tail():
        pl.run_scoped(zeros, out_tile)


@one_kernel_per_shape("config", "scale_block", "interpret")
def grouped_gemm_mgpu(lhs, rhs, group_sizes, rhs_scale=None, *, config: GroupedConfig | None = None,
                      scale_block: int = 128, interpret=False):
    """``lhs [M, K]`` (rows sorted by group) x ``rhs [G, K, N]`` per ``group_sizes [G]`` -> ``[M, N]``.

    Args:
      lhs: ``[M, K]`` bf16, the rows of group 0, then group 1, ...
      rhs: ``[G, K, N]`` bf16, or float8_e4m3fn with ``rhs_scale``.
      group_sizes: ``[G]`` integers (int32); rows past their sum come out as zeros.
      rhs_scale: None, or the FP8 weights' block scales, float32 ``[G, cdiv(K, scale_block),
        cdiv(N, scale_block)]``.
      config: the tiling; ``default_config(M, K, N, G)`` when None.
      scale_block: the side of a scale's square block of weights (``tile_k`` and ``tile_n`` divide it).
      interpret: run Mosaic GPU's interpreter on the CPU (CPU tests): ``True`` for its default
        ``plgpu.InterpretGPUParams()``, or such an instance.

    Returns:
      ``out [M, N]`` bf16 (f32 accumulation).
    """
    if config is None and lhs.ndim == 2 and rhs.ndim == 3:
        config = default_config(lhs.shape[0], lhs.shape[1], rhs.shape[2], rhs.shape[0])
    config = config or GroupedConfig()
    _check(lhs, rhs, group_sizes, rhs_scale, config, scale_block)
    m, k = lhs.shape
    g, _, n = rhs.shape
    if m == 0 or g == 0:
        return jnp.zeros((m, n), jnp.bfloat16)
    row_tile = config.row_tile
    m8 = max(-(-m // _ALIGN) * _ALIGN, row_tile)
    if m8 != m:  # every row tile reads row_tile rows from an 8-aligned row inside lhs
        lhs = jnp.pad(lhs, ((0, m8 - m), (0, 0)))
    tiles = num_tiles(m, g, row_tile)
    args = [tile_schedule(group_sizes, m, row_tile), lhs, rhs]
    scale_shape = None
    if rhs_scale is not None:
        scale_shape = tuple(rhs_scale.shape[1:])
        args.append(rhs_scale.astype(jnp.float32).reshape(-1))
    steps = k // config.tile_k
    if interpret is True:
        # Mosaic GPU's own interpreter: Pallas' generic one cannot run the grid's axis_index.
        interpret = plgpu.InterpretGPUParams()
    kernel = plgpu.kernel(
        functools.partial(_grouped_kernel, num_groups=g, tiles=tiles, steps=steps,
                          stages=min(config.max_concurrent_steps, steps), tile_n=config.tile_n,
                          tile_k=config.tile_k, row_tile=row_tile, scale_block=scale_block,
                          scale_shape=scale_shape),
        out_type=jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        grid=(n // config.tile_n, tiles),
        grid_names=("n", "t"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret or None,
    )
    return kernel(*args)
