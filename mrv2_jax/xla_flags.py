"""XLA flags the engine wants by default, set before JAX starts its backend, and the per-compile
options of the step functions.

`--xla_gpu_enable_command_buffer=+WHILE` adds while loops to the ops XLA records into command
buffers (CUDA graphs). The decoder's layers run as a `lax.scan` (a while loop over stacked
weights) and fused decode is a `lax.while_loop`; outside command buffers every loop iteration
is launched from the host.

`--xla_gpu_enable_dynamic_slice_fusion=true` lets a cuBLAS GEMM read one layer's slice of the
stacked weights in place. It pays only together with `step_compiler_options`: XLA's own Triton
GEMMs cannot take a sliced operand, so with them every layer's weights were copied out of the
stack each step. The throughput each flag gained is in docs/benchmarks.md (runner A/B, and
"cuBLAS GEMMs on the stacked weights").

`--xla_cmd_buffer_trace_cache_size=64` lets XLA keep 64 recorded variants of each traced command
(a cuBLAS GEMM, recorded by stream capture, keyed by its buffers' addresses) instead of 16. In a
looped program a GEMM that reads one layer's weights in place has a different address set for
every layer, so with the default 16 each call of a 28-layer loop records every GEMM again; with 64
the recordings are reused wherever the other buffers keep their addresses between calls, and the
host's call of a looped program on an idle device costs about half (in the engine's back-to-back
loop the default allocator still moves them; docs/benchmarks.md, "Where a looped step's call
goes"). The flag is read from XLA_FLAGS only, not from per-compile options. Models of more than ~60
layers need a larger value.

`--xla_gpu_memory_limit_slop_factor=10000` is for correctness, not speed, and stays on with
`MRV2_DEFAULT_XLA_FLAGS=0`. XLA:GPU's estimate of a step program's peak memory counts the donated
KV cache, updated in place, several times over; once the KV cache is a large share of the GPU's
memory, that estimate passes XLA's memory limit and XLA rewrites the program to save memory (its
log says the rematerialisation pass cannot reach the limit). On the H200 the rewritten step
programs with unrolled layers dropped the step's update of each row's token count: later steps read
the wrong input tokens, and fused decode found no row decoding (docs/benchmarks.md, "Wrong tokens
at a large KV cache"). The step programs' real working memory is a few MB beside their donated
inputs, so the limit is raised out of reach (100x the device's memory) and no such rewrite happens.

An engine on one GPU also gets JAX's VMM allocator (`XLA_PYTHON_CLIENT_ALLOCATOR=vmm`, built on
CUDA's virtual memory management) in place of its default best-fit pool: with it the host's call of
a 256-row decode step costs about a third, and the server's prompt steps about half, of what they
cost with the pool, at the same throughput (docs/benchmarks.md, "The VMM allocator"). EngineConfig
sets it (`prefer_vmm_allocator`), where the number of devices is known; XLA's VMM allocator has not
been run with NCCL collectives here, so engines over several GPUs keep the pool. It takes effect
only when that engine is what starts JAX's backend in its process. The allocator keeps no memory
stats: the KV cache is then sized by runner/device_memory.py.

A flag or allocator the user already set wins (including turning command buffers off), and so does
`MRV2_DEFAULT_XLA_FLAGS=0` for the performance flags and the allocator. XLA reads XLA_FLAGS once,
when the backend starts: importing mrv2_jax after JAX has already run a computation leaves the
flags as they were.
"""

from mrv2_jax import envs

DEFAULT_FLAGS = {"--xla_gpu_enable_command_buffer": "+WHILE", "--xla_gpu_enable_dynamic_slice_fusion": "true",
                 "--xla_cmd_buffer_trace_cache_size": "64"}
REQUIRED_FLAGS = {"--xla_gpu_memory_limit_slop_factor": "10000"}
ONE_GPU_ALLOCATOR = "vmm"


def _defaults_on() -> bool:
    return envs.read("MRV2_DEFAULT_XLA_FLAGS")


def apply_default_xla_flags() -> None:
    """Add the default flags that XLA_FLAGS does not already set."""
    wanted = REQUIRED_FLAGS | (DEFAULT_FLAGS if _defaults_on() else {})
    flags = envs.get_xla_flags()
    missing = [f"{name}={value}" for name, value in wanted.items() if name not in flags]
    if missing:
        envs.set_xla_flags(" ".join([flags, *missing]).strip())


def prefer_vmm_allocator(devices_per_engine: int) -> None:
    """Ask JAX for its VMM allocator when an engine runs on one device, unless the user chose an
    allocator or turned the defaults off. Call before JAX starts its backend (it reads the variable
    then); on CPUs the variable is ignored."""
    if devices_per_engine == 1 and _defaults_on() and not envs.get_xla_allocator():
        envs.set_xla_allocator(ONE_GPU_ALLOCATOR)


def step_compiler_options(param_leaves, backend: str | None = None) -> dict:
    """XLA options for compiling the engine's step functions over these parameters on `backend`
    (default: JAX's default backend).

    On GPUs, cuBLAS instead of Triton for the GEMMs (see the module docstring), unless a weight
    is FP8: an FP8 block-scaled linear (models/fp8.py) relies on a Triton GEMM fusing the
    dequantisation into the dot; cuBLAS would first write a bf16 copy of the weight every step.
    A user's own `--xla_gpu_enable_triton_gemm` in XLA_FLAGS wins. Other backends get no
    options (they have no use for them), so CPU compiles stay exactly as they were."""
    import jax

    if (backend or jax.default_backend()) != "gpu":
        return {}
    if not _defaults_on() or "--xla_gpu_enable_triton_gemm" in envs.get_xla_flags():
        return {}
    if any("float8" in str(getattr(leaf, "dtype", "")) for leaf in param_leaves):
        return {}
    return {"xla_gpu_enable_triton_gemm": False}
