"""Compiling every step variant at start-up, in parallel on GPUs.

Tracing and lowering hold the GIL and are quick, so they run one after another here; XLA's
compilation releases the GIL and dominates (seconds per bucket for a 28-layer model), so the
lowered modules are compiled on a thread pool. With the persistent compilation cache, a later
start only loads them.

On the CPU backend they compile one at a time: XLA:CPU (jax 0.11.2) can crash (a segmentation
fault in `compilation_cache.put_executable_and_time`) serialising one executable for the
persistent cache while another thread compiles.
"""

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
from tqdm.auto import tqdm


def compile_workers() -> int:
    """Threads that compile step programs at once: one on CPUs (see above), up to 16 elsewhere."""
    return 1 if jax.default_backend() == "cpu" else max(1, min(os.cpu_count() or 1, 16))


def compile_all(lowered: dict, show_progress: bool, desc: str = "compiling step buckets",
                compiler_options: dict | None = None, compile_one: Callable | None = None) -> dict:
    """{key: jax Lowered} -> {key: Compiled}, compiled concurrently, with a progress bar;
    `compiler_options`: XLA options for every module (xla_flags.step_compiler_options);
    `compile_one(key, lowered)`, when given, compiles in place of `lowered.compile`."""
    workers = min(len(lowered), compile_workers())
    if compile_one is None:
        def compile_one(_, low):
            return low.compile(compiler_options or None)
    with ThreadPoolExecutor(workers) as pool, tqdm(total=len(lowered), desc=desc, disable=not show_progress) as bar:
        futures = {key: pool.submit(compile_one, key, low) for key, low in lowered.items()}
        compiled = {}
        for key, future in futures.items():
            compiled[key] = future.result()
            bar.update(1)
    return compiled
