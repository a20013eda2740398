"""What the Mosaic GPU kernels here share: whether the GPU has wgmma, the SM count their default
configs plan for, and the tile rules of a wgmma whose M side is a weight tile."""

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


def check_weight_tile(tile_n: int, tile_k: int) -> None:
    """ValueError unless a [tile_n, tile_k] bf16 weight tile can be wgmma's M x K operand."""
    if tile_n <= 0 or tile_n % 64:
        raise ValueError(f"tile_n = {tile_n} must be a positive multiple of 64 (wgmma's M)")
    if tile_k <= 0 or tile_k % 16:
        raise ValueError(f"tile_k = {tile_k} must be a positive multiple of 16 (wgmma's K for bf16)")
