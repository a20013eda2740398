"""Timing device work from the host: warm up, then time each call to completion."""

import time

import jax


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
