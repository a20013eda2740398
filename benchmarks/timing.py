"""Timing device work from the host: each call to completion, or its kernels' time in a trace."""

import time

import jax
import jax.numpy as jnp

from mrv2_jax.bench.trace import profile_kernels


def time_calls(fn, args, runs: int, warmup: int) -> list[float]:
    """Wall seconds of `runs` calls of `fn(*args)`, each waited for with block_until_ready,
    after `warmup` untimed calls (compilation, caches). Take the median of the result."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return samples


def device_ms(fn, args, calls: int) -> float:
    """Device ms per call (summed kernel time), or the wall ms per call of a burst without a GPU."""
    jax.block_until_ready(fn(*args))  # compile outside the trace
    kernels = profile_kernels(fn, args, calls)
    if kernels:
        return sum(k["ms_per_step"] for k in kernels)
    return burst_seconds(fn, args, calls) * 1e3


def burst_seconds(fn, args, calls: int) -> float:
    """Wall seconds per call of `calls` calls dispatched back to back and waited for once: the device's
    pace wherever the host dispatches a call faster than the device runs it (a call waited for alone also
    counts its dispatch and the wait)."""
    t0 = time.perf_counter()
    jax.block_until_ready([fn(*args) for _ in range(calls)])
    return (time.perf_counter() - t0) / calls


def copy_bandwidth(nbytes: int = 2 << 30, calls: int = 20) -> float:
    """Bytes a second this device reads plus writes adding one to a large bf16 array in place: the ceiling
    a memory-bound kernel is measured against (a card's DRAM peak is never reached by a plain copy)."""
    step = jax.jit(lambda a: a + 1, donate_argnums=0)
    x = jax.block_until_ready(step(jnp.zeros(nbytes // 2, jnp.bfloat16)))
    t0 = time.perf_counter()
    for _ in range(calls):
        x = step(x)
    jax.block_until_ready(x)
    return 2 * nbytes * calls / (time.perf_counter() - t0)
