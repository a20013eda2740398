"""Allocating the paged KV cache: two stacked arrays sized from a memory budget."""

import functools

import jax
import jax.numpy as jnp

from mrv2_jax.runner.device_memory import memory_in_use_and_total


def num_blocks_for_budget(model_state, block_size: int, dtype, gpu_memory_utilization: float,
                          reserve_bytes: int = 2 << 30, extra_kv_bytes_per_token: int = 0, kv_shards: int = 1) -> int:
    """How many KV blocks fit in `gpu_memory_utilization` of device memory after what is already
    allocated (the weights) and a reserve for activations, logits and XLA workspace
    (runner/device_memory.py says where the figures come from). On CPU a small fixed pool is used;
    another device without memory figures raises ValueError.
    `extra_kv_bytes_per_token`: another cache indexed by the same blocks (a draft model's), which each
    block pays for too. `kv_shards`: devices the KV heads are split over (tensor parallelism: its heads;
    pipeline parallelism: its layers): each holds 1/kv_shards of a block, next to its share of the weights."""
    device = jax.local_devices()[0]
    memory = memory_in_use_and_total(device)
    if memory is None:
        if device.platform == "cpu":
            return 1024
        # A fixed small pool would serve far fewer tokens than the device holds, without a word.
        raise ValueError(f"{device.device_kind} reports no memory limit (neither its allocator nor a CUDA "
                         "driver gives memory figures), so the KV cache cannot be sized from "
                         "gpu_memory_utilization; set num_gpu_blocks (--num-gpu-blocks)")
    in_use, total = memory
    free = int(total * gpu_memory_utilization) - in_use - reserve_bytes
    per_block = (model_state.kv_bytes_per_token(dtype) // kv_shards + extra_kv_bytes_per_token) * block_size
    if free < per_block:
        raise ValueError(f"no memory left for the KV cache ({free / 2**30:.2f} GiB free after the "
                         f"weights); raise gpu_memory_utilization or use a smaller model")
    return free // per_block


def allocate_kv_cache(model_state, num_blocks: int, block_size: int, dtype=jnp.bfloat16, tensor_parallel=None):
    """(k_cache, v_cache), each [num_layers, num_blocks, num_kv_heads, block_size, head_dim].
    Zero-filled: since jax 0.11 `jnp.empty` is uninitialised memory. `tensor_parallel`: a
    runner.tensor_parallel.TensorParallel, which splits the KV heads over its devices."""
    shape = model_state.kv_cache_shape(num_blocks, block_size)
    if tensor_parallel is not None:
        return tensor_parallel.kv_zeros(shape, dtype), tensor_parallel.kv_zeros(shape, dtype)
    return _zero_pair(shape, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _zero_pair(shape, dtype):
    """Both caches made by one compiled program (eagerly, each jnp.zeros is a program of its own)."""
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
