"""Probe: does an executable that JAX took from its persistent compilation cache serialise again
completely on this backend? `runner/program_store.py` does not save such programs, since on
XLA:CPU (jax 0.11.2) the copy loses its kernels ("Function ... not found" when it runs).

    python -m benchmarks.cache_reserialize

Runs itself twice in child processes on one empty cache folder: the first compiles afresh (and
fills the cache), the second takes the program from the cache; each serialises its program, loads
the copy and runs it against the original. Prints one line per child and "same on this backend: yes/no".
"""

from __future__ import annotations

import subprocess
import sys
import tempfile

import numpy as np


def child(cache: str, label: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax.experimental import serialize_executable

    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    x = jnp.linspace(-1, 1, 64 * 64, dtype=jnp.float32).reshape(64, 64)
    y = jnp.linspace(0, 2, 64 * 64, dtype=jnp.float32).reshape(64, 64)
    compiled = jax.jit(lambda x, y: -jnp.power(x, 3.0) + jnp.tanh(y) @ x).lower(x, y).compile()
    copy = serialize_executable.deserialize_and_load(*serialize_executable.serialize(compiled))
    # Against the program it was copied from: a GPU's f32 matmul runs in TF32 by default, so numpy
    # is only a loose check.
    want = np.asarray(compiled(x, y))
    assert np.allclose(want, -np.power(np.asarray(x), 3.0) + np.tanh(np.asarray(y)) @ np.asarray(x), atol=0.05)
    try:
        ok = np.array_equal(np.asarray(copy(x, y)), want)
        print(f"{label} ({jax.default_backend()}): the re-serialised copy {'runs and matches' if ok else 'DIFFERS'}")
    except Exception as e:  # noqa: BLE001 - the failure is the finding
        print(f"{label} ({jax.default_backend()}): the re-serialised copy fails: {type(e).__name__}: {e}")


def main() -> None:
    cache = tempfile.mkdtemp(prefix="reserialize-cache-")
    lines = [subprocess.run([sys.executable, "-m", "benchmarks.cache_reserialize", cache, label],
                            capture_output=True, text=True).stdout.strip() for label in ("fresh compile", "from cache")]
    print("\n".join(lines))
    print("same on this backend:", "yes" if all("matches" in line for line in lines) else "no")


if __name__ == "__main__":
    if len(sys.argv) == 3:
        child(*sys.argv[1:])
    else:
        main()
