"""XLA flags the engine wants by default, set before JAX starts its backend.

`--xla_gpu_enable_command_buffer=+WHILE` adds while loops to the ops XLA records into command
buffers (CUDA graphs). The decoder's layers run as a `lax.scan` (a while loop over stacked
weights) and fused decode is a `lax.while_loop`; outside command buffers every loop iteration
is launched from the host. Measured on an H200 (docs/benchmarks.md, runner A/B): S1 at 256
sequences, v2-async, 39,984 -> 42,016 output tok/s.

A flag the user already set for command buffers wins (including turning them off), and so does
`MRV2_DEFAULT_XLA_FLAGS=0`. XLA reads XLA_FLAGS once, when the backend starts: importing
mrv2_jax after JAX has already run a computation leaves the flags as they were.
"""

import os

DEFAULT_FLAGS = {"--xla_gpu_enable_command_buffer": "+WHILE"}


def apply_default_xla_flags() -> None:
    if os.environ.get("MRV2_DEFAULT_XLA_FLAGS", "1") == "0":
        return
    flags = os.environ.get("XLA_FLAGS", "")
    missing = [f"{name}={value}" for name, value in DEFAULT_FLAGS.items() if name not in flags]
    if missing:
        os.environ["XLA_FLAGS"] = " ".join([flags, *missing]).strip()
