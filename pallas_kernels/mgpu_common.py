"""What the Mosaic GPU kernels here share: whether the GPU has wgmma, the SM count their default
configs plan for, one kernel per shape for their wrappers, the input checks of the paged attention
kernels, and the tile rules of a wgmma whose M side is a weight tile."""

import functools

import jax

H200_SMS = 132  # the SM count assumed when there is no GPU to ask


def has_wgmma() -> bool:
    """Whether JAX's default device is a Hopper-class GPU (compute capability 9.x: H100, H200), whose
    wgmma and TMA the kernels here are built on."""
    if jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def device_sm_count() -> int:
    """The GPU's SM count, or H200_SMS without a GPU (configs are then planned for the H200)."""
    if jax.default_backend() == "gpu":
        return jax.devices()[0].core_count
    return H200_SMS


def one_kernel_per_shape(*static_argnames: str):
    """A kernel wrapper's decorator: the wrapper jitted with these arguments static, so that its calls at
    one set of shapes and static arguments share one lowering, hence one Mosaic GPU module and one
    ``kernel_hash``. JAX's Mosaic GPU lowering names every module it lowers with a process-wide counter
    (the ``mosaic_gpu.dump_basename`` attribute), so N plain calls of one kernel in a program (a model's
    unrolled layers) reach XLA as N distinct kernels, each compiled and loaded on its own. XLA inlines
    the jitted call: the program runs the same kernels either way."""
    return functools.partial(jax.jit, static_argnames=static_argnames)


def check_bf16_paged_attention(q, k_cache, v_cache) -> None:
    """ValueError unless ``q [*, Hq, D]`` and the caches ``[num_layers, num_blocks, Hkv, block_size, D]``
    agree and are all bfloat16 (``q``'s rank is the caller's to check)."""
    if k_cache.ndim != 5 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_layers, num_blocks, Hkv, block_size, D], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape[4] != q.shape[-1]:
        raise ValueError(f"q's head_dim = {q.shape[-1]} differs from the cache's {k_cache.shape[4]}")
    if q.dtype != "bfloat16" or k_cache.dtype != "bfloat16" or v_cache.dtype != "bfloat16":
        raise ValueError(f"q and the caches must be bfloat16, got q {q.dtype}, k_cache {k_cache.dtype}, "
                         f"v_cache {v_cache.dtype}")


def check_weight_tile(tile_n: int, tile_k: int) -> None:
    """ValueError unless a [tile_n, tile_k] bf16 weight tile can be wgmma's M x K operand."""
    if tile_n <= 0 or tile_n % 64:
        raise ValueError(f"tile_n = {tile_n} must be a positive multiple of 64 (wgmma's M)")
    if tile_k <= 0 or tile_k % 16:
        raise ValueError(f"tile_k = {tile_k} must be a positive multiple of 16 (wgmma's K for bf16)")
