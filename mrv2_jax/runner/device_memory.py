"""How much memory a device's allocator may hold and how much is in use: from the allocator's stats,
or, for allocators that keep none (XLA_PYTHON_CLIENT_ALLOCATOR=vmm), from the CUDA driver."""

import ctypes

import jax

from mrv2_jax import envs


def memory_in_use_and_total(device) -> tuple[int, int] | None:
    """(bytes in use, bytes the allocator may hold), or None where neither source answers (CPU, or an
    accelerator whose allocator keeps no stats and which is not a CUDA device). Without stats, in use
    is what this process's live arrays hold on the device (the driver's own figure still counts memory
    the allocator has freed but not yet given back, such as an engine's KV cache deleted a moment ago),
    and the limit is XLA_PYTHON_CLIENT_MEM_FRACTION of the device's memory by the CUDA driver: the budget
    JAX gives the VMM allocator, past which an allocation fails however much the device has free."""
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
        return stats.get("bytes_in_use", 0), stats["bytes_limit"]
    if device.platform != "gpu":
        return None
    free_and_total = cuda_free_and_total(device.local_hardware_id)
    if free_and_total is None:
        return None
    return bytes_of_live_arrays(device), int(free_and_total[1] * envs.get_xla_memory_fraction())


def bytes_of_live_arrays(device) -> int:
    """Bytes of this process's live arrays held on `device` (their shards there)."""
    return sum(shard.data.nbytes for array in jax.live_arrays() for shard in array.addressable_shards
               if shard.device == device)


def cuda_free_and_total(ordinal: int) -> tuple[int, int] | None:
    """cuMemGetInfo of CUDA device `ordinal` (numbered as CUDA_VISIBLE_DEVICES leaves them, as JAX's
    local_hardware_id is), asked in the device's primary context, the one XLA runs in; None
    without a CUDA driver or on any driver error."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        cuda.cuMemGetInfo_v2, cuda.cuDevicePrimaryCtxRelease_v2  # a driver too old for these: None
    except (OSError, AttributeError):
        return None
    device, context = ctypes.c_int(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), ordinal):
        return None
    if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device):
        return None
    try:
        if cuda.cuCtxPushCurrent_v2(context):
            return None
        try:
            status = cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        finally:
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(device)
    return (free.value, total.value) if status == 0 else None
